"""The demo tokenizer: a small byte-level BPE trained on stdlib sources, saved as a HF tokenizer.

Byte-level so that every string encodes; ChatML specials so that the demo target speaks the same
chat format as Qwen models; a `<|mask|>` token that DFlash drafters use as `mask_token_id`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_eval.demo.corpus import corpus_fingerprint, select_sources

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)  # ids 0..3, in this order

DEFAULT_VOCAB_SIZE = 4096
CORPUS_BYTES = 3_000_000
BUILD_INFO = "demo_build.json"

# ChatML. String content or OpenAI-style content parts (servers may pass either).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Pre-tokenization: runs of letters/digits/underscore (optionally after one space), runs of other
# symbols (optionally after one space), newlines, then remaining spaces. Unlike GPT-2's
# `\s+(?!\S)`, no split depends on what follows a whitespace run, so that text decoded from the
# model re-encodes to the same ids more often (the fetch stage retokenizes server text).
_PRETOKENIZE = r" ?[A-Za-z_0-9]+| ?[^\sA-Za-z_0-9]+|\n+| +|\t+|\s"


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE on `texts`; specials first so their ids are 0..3 on every build."""
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The HF wrapper with ChatML template, eos `<|im_end|>` and pad `<|endoftext|>`."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, MASK],
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tokenizer(
    out_dir: Path, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE, corpus_bytes: int = CORPUS_BYTES
) -> None:
    """Train the demo tokenizer on a seeded stdlib subset and save it (HF format) to `out_dir`."""
    out_dir = Path(out_dir)
    files = select_sources(seed=seed, max_bytes=corpus_bytes)
    tok = train_tokenizer([f.text for f in files], vocab_size=vocab_size)
    hf = wrap_tokenizer(tok)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    info = {
        "kind": "dflash-eval demo tokenizer",
        "seed": seed,
        "vocab_size": tok.get_vocab_size(),
        "special_token_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "corpus": corpus_fingerprint(files),
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def mask_token_id(tokenizer_dir: Path) -> int:
    """The `<|mask|>` id that a DFlash drafter for the demo target must use."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tid = tok.token_to_id(MASK)
    if tid is None:
        raise ValueError(f"{tokenizer_dir} has no {MASK} token: not a demo tokenizer")
    return tid


# ---------------------------------------------------------------- CLI (wired as `demo-tokenizer`)


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-eval demo-tokenizer`."""
    parser.add_argument("--out", type=Path, required=True, help="output directory (HF tokenizer files)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stdlib file subset")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)


def run_tokenizer(args: argparse.Namespace) -> int:
    """Build the tokenizer; prints where it went and how long it took."""
    start = time.perf_counter()
    build_tokenizer(args.out, seed=args.seed, vocab_size=args.vocab_size)
    print(f"demo tokenizer -> {args.out} ({time.perf_counter() - start:.1f} s)")
    return 0
