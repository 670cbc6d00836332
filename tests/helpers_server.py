"""Test helpers for the server and fetch tests: a tiny real target model and a free port.

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
# How far the eos row of the LM head is scaled up: large enough that some greedy completions stop
# on eos within a few tokens, small enough that others run to max_tokens (both paths get tested).
EOS_LOGIT_SCALE = 3.0


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
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
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


def build_tiny_target(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen3_5ForCausalLM (1 Gated DeltaNet + 1 full-attention layer) and its tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    config = Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that greedy output differs between prompts
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        # Never generate a special token other than eos (its text would vanish on decode), and make eos likelier.
        for token in SPECIAL_TOKENS + ["<unk>"]:
            if token != EOS:
                model.lm_head.weight[tok.convert_tokens_to_ids(token)] = 0.0
        model.lm_head.weight[tok.eos_token_id] *= EOS_LOGIT_SCALE
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    return out_dir


def write_prompts(path: Path, n: int) -> Path:
    """Write `n` short chat prompts as JSONL."""
    with open(path, "w") as fh:
        for i in range(n):
            rec = {"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}
            fh.write(json.dumps(rec) + "\n")
    return path
