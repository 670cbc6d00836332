"""A character-level tokenizer, short chat prompts and a free port: the inputs of the fetch tests and of
benchmarks/fetch_speed.py.

The tokenizer is character level on purpose: decoding and re-encoding a completion then gives the
same ids back (unless a special token was generated), which the fetch tests rely on to compare the
retokenized completion with `generate`.
"""

from __future__ import annotations

import json
import socket
import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_tokenizer(out_dir: Path):
    """Write a character-level PreTrainedTokenizerFast with a ChatML template to `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ["<unk>"] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


def write_prompts(path: Path, n: int) -> Path:
    """Write `n` short chat prompts as JSONL."""
    with open(path, "w") as fh:
        for i in range(n):
            rec = {"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}
            fh.write(json.dumps(rec) + "\n")
    return path
