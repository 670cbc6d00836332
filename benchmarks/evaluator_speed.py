"""All-anchor evaluator vs a sequential reference-style loop, on a Qwen3.6-27B-DFlash-shaped drafter.

Random weights (5 layers, hidden 5120, 32 heads / 8 KV heads, head dim 128, intermediate 17408,
block 16, vocab 248320, 4 sliding-window + 1 full-attention layer) and random cached states for
2048-token sequences. The sequential loop runs `dflash.DFlashDraftModel` one anchor at a time with
its KV cache, as `dflash_generate` does. FLOPs per anchor: the drafter layers' matmuls over B
tokens plus the LM head over B - 1 positions (attention scores not counted). Prints a table and
appends it to benchmarks/results/evaluator_speed.md.

    python benchmarks/evaluator_speed.py --device cuda --seq-len 2048 --samples 2
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from record import print_and_record  # benchmarks/record.py (the script's own folder)
from transformers import Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 790.0  # bf16 dense matrix rate measured on one H200


def drafter_config(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                   block: int, vocab: int, window: int, num_target_layers: int = 64) -> Qwen3Config:
    ids = [round(1 + i * (num_target_layers - 4) / (layers - 1)) for i in range(layers)]
    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=40960,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], use_sliding_window=True,
        sliding_window=window, max_window_layers=0, block_size=block, num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": vocab - 250, "target_layer_ids": ids}, rope_theta=10_000_000.0,
    )


def flops_per_anchor(config: Qwen3Config) -> float:
    h, q, kv, i = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim, config.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return 2.0 * (layer * config.num_hidden_layers * config.block_size + h * config.vocab_size * (config.block_size - 1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def sequential(model, embed, lm_head, features, tokens, anchors: list[int]) -> float:
    """Seconds for the reference-style loop over `anchors` (first call excluded: it prefills)."""
    from dflash.model import _crop_to, _make_cache

    cache = _make_cache(model.config)
    block = model.block_size
    previous, started = 0, None
    for index, anchor in enumerate(anchors):
        if index == 1:
            sync(features.device)
            started = time.perf_counter()
        ids = torch.full((1, block), model.mask_token_id, device=features.device)
        ids[0, 0] = tokens[anchor]
        out = model(target_hidden=features[None, previous:anchor], noise_embedding=torch.nn.functional.embedding(ids, embed),
                    position_ids=torch.arange(previous, anchor + block, device=features.device)[None],
                    past_key_values=cache, use_cache=True)[:, 1 - block:, :]
        _crop_to(cache, anchor)
        draft = model.compute_logits(out, lambda x: torch.nn.functional.linear(x, lm_head)).argmax(dim=-1)
        int((draft[0] == tokens[anchor + 1:anchor + block]).cumprod(0).sum())  # a host sync, as online
        previous = anchor
    sync(features.device)
    return time.perf_counter() - started


@torch.inference_mode()
def all_anchor(runner, features, tokens, prompt_len: int, methods: dict, chunk: int) -> tuple[float, int]:
    from dflash_eval.evaluate.acceptance import sequence_limits
    from dflash_eval.evaluate.anchors import evaluate_sample

    limits = sequence_limits(prompt_len, len(tokens), None, False)
    sync(features.device)
    started = time.perf_counter()
    evaluate_sample(runner, features, tokens, limits, set(), chunk=chunk, **methods)
    sync(features.device)
    return time.perf_counter() - started, limits.total_len - 1 - prompt_len


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--sequential-anchors", type=int, default=96)
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check the script on a CPU")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/evaluator_speed.md")
    args = parser.parse_args()
    from dflash import DFlashDraftModel

    from dflash_eval.evaluate.blocks import BlockDrafter

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = dict(layers=5, hidden=5120, heads=32, kv_heads=8, head_dim=128, intermediate=17408, block=16,
                 vocab=248320, window=2048)
    if args.small:
        shape.update(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4096)
    config = drafter_config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        lm_head = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
    runner = BlockDrafter(model, embed, lm_head, config.dflash_config["mask_token_id"]).to(device)
    width = config.hidden_size * len(config.dflash_config["target_layer_ids"])
    samples = [(torch.randn(args.seq_len, width, device=device, dtype=dtype),
                torch.randint(0, config.vocab_size - 300, (args.seq_len,), device=device)) for _ in range(args.samples)]
    flops = flops_per_anchor(config)
    rows = []

    def record(name: str, anchors: int, seconds: float) -> None:
        rate = anchors / seconds
        rows.append((name, anchors, seconds, rate, rate * flops / 1e12))
        print(f"{name}: {rate:,.1f} anchors/s", flush=True)

    features, tokens = samples[0]
    mid = args.seq_len // 2
    anchors = list(range(mid, mid + args.sequential_anchors + 1))
    sequential(model, embed, lm_head, features, tokens, anchors[:8])  # warm-up
    record("sequential (reference-style loop, KV cache)", len(anchors) - 1,
           sequential(model, embed, lm_head, features, tokens, anchors))
    variants = {
        "chain B only": {},
        "chain B + DDTree 8/16/32/64 + top-k": {"budgets": [8, 16, 32, 64], "topk": [1, 4, 16]},
        "chain 2..B + DDTree + top-k": {"block_sizes": range(2, config.block_size + 1), "budgets": [8, 16, 32, 64],
                                        "topk": [1, 4, 16]},
    }
    for name, methods in variants.items():
        for chunk in (args.chunks if name == "chain B only" else [max(args.chunks)]):
            all_anchor(runner, *samples[0], args.prompt_len, methods, chunk)  # warm-up
            total_s, total_anchors = 0.0, 0
            for features, tokens in samples:
                seconds, count = all_anchor(runner, features, tokens, args.prompt_len, methods, chunk)
                total_s, total_anchors = total_s + seconds, total_anchors + count
            record(f"all-anchor, {name}, chunk {chunk}", total_anchors, total_s)
    base = rows[0][3]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    lines = [f"## evaluator speed: {gpu}, {args.dtype}, seq {args.seq_len}, prompt {args.prompt_len}, "
             f"shape {'small' if args.small else 'Qwen3.6-27B-DFlash'}, torch {torch.__version__}", "",
             f"FLOPs per anchor (drafter layers over B + LM head over B-1): {flops / 1e9:.1f} G; peak {PEAK_TFLOPS} TFLOP/s", "",
             "| method | anchors | seconds | anchors/s | x sequential | TFLOP/s | % of peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {a} | {s:.2f} | {r:,.1f} | {r / base:.1f} | {t:.1f} | {100 * t / PEAK_TFLOPS:.1f}% |"
              for n, a, s, r, t in rows]
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
