"""The target's serving-step profile (T_AR, T_verify(n)) on a Qwen3.6-27B-shaped target, measured twice: repeatability.

Random weights, bf16, HF transformers with fla's kernels (batch 1, a KV cache prefilled with
`--context` tokens), exactly as the profile_target rule measures it (tools/target_timing.py). `--layers` builds
fewer of the 64 layers (keeping the 3 linear : 1 full pattern) and scales the times by 64/layers:
the layers dominate, the embedding and LM head are then counted 64/layers times too many (state
it beside any number). Two runs back to back give the repeatability: their ratio per size, each median's
repeats (until its 95% CI is within ±2%, or `--seconds-per-size`) and whether it got there (the profile's
`unstable`); the line under the table says how many sizes agree within 5% (speedup/timing.py's `compare`). This is a model of a server,
not a measurement of one: SGLang runs the same step under CUDA graphs with its own kernels.

    python benchmarks/serving_profile.py --device cuda --context 2048
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from extract_speed import (  # benchmarks/ (the script's own folder)
    build_target,
    target_config,
)
from record import print_and_record, smoke_mode

ROOT = Path(__file__).resolve().parents[1]
from evaluator_speed import SHAPES, drafter_config

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.draft_timing import drafter_step_ms
from dflash_eval.extract.backends import bind_backend
from dflash_eval.speedup.timing import compare
from dflash_eval.tools.target_timing import DEFAULT_VERIFY_TOKENS, measure_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=DEFAULT_VERIFY_TOKENS,
        help="tokens verified, comma-separated (default: what extraction measures by default)",
    )
    parser.add_argument("--seconds-per-size", type=float, default=None, help="cap per size (default: extraction's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--drafter-shape",
        default="27b",
        choices=[*sorted(SHAPES), "none"],
        help="also time T_draft: one block forward + LM head of a drafter of this shape (random "
        "weights, the target's embedding and LM head), as evaluation times it",
    )
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/serving_profile.md")
    smoke_mode(
        parser,
        device="cpu",
        layers=4,
        hidden=32,
        vocab=300,
        context=16,
        repeats=1,
        drafter_shape="demo",
        seconds_per_size=0.05,
        sizes=[1, 2, 9],
        dtype="float32",
        record=None,
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    bind_backend("fla" if device.type == "cuda" else "torch", device)  # chosen here, not by what imports
    started = time.perf_counter()
    model = build_target(target_config(args.layers, args.hidden, args.vocab), device, getattr(torch, args.dtype))
    built = time.perf_counter() - started
    scale = 64 / args.layers
    runs, seconds = [], []
    for _ in range(2):
        began = time.perf_counter()
        runs.append(
            measure_target(model, args.context, args.repeats, args.sizes, seconds_per_size=args.seconds_per_size)
        )
        seconds.append(time.perf_counter() - began)
    name = runs[0]["device"]
    lines = [
        (
            f"## serving profile: {name}, torch {torch.__version__}, Qwen3.6-27B shape with {args.layers} of 64 "
            f"layers (times x {scale:g}), {args.dtype}, batch 1, context {args.context}, {args.repeats} repeats"
        ),
        "",
        f"model built in {built:.0f} s; each profile took {seconds[0]:.1f} s and {seconds[1]:.1f} s",
        "",
        "| tokens verified | run 1 ms | min..max | repeats | run 2 ms | min..max | repeats | run 2 / run 1 |",
        "|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for n in runs[0]["t_verify_ms"]:
        a, b = runs[0]["t_verify_ms"][n] * scale, runs[1]["t_verify_ms"][n] * scale
        sa = "..".join(f"{scale * x:.2f}" for x in runs[0]["spread"]["t_verify_ms"][n])
        sb = "..".join(f"{scale * x:.2f}" for x in runs[1]["spread"]["t_verify_ms"][n])
        ra, rb = (
            f"{run['spread']['repeats'][n]}{'' if int(n) not in run['spread']['unstable'] else ' (capped)'}"
            for run in runs
        )
        lines.append(f"| {n} | {a:.2f} | {sa} | {ra} | {b:.2f} | {sb} | {rb} | {b / a:.3f} |")
    agreement = compare(runs[0]["t_verify_ms"], runs[1]["t_verify_ms"], "serving profile run 2 vs run 1")
    lines += [
        "",
        f"{len(agreement['ratios']) - len(agreement['beyond_5_percent'])} of {len(agreement['ratios'])} "
        f"sizes agree within 5% (beyond: {', '.join(agreement['beyond_5_percent']) or 'none'})",
    ]
    if args.drafter_shape != "none":
        lines += ["", *drafter_lines(model, args, device)]
    print_and_record(lines, args.record)
    return 0


def drafter_lines(target, args: argparse.Namespace, device: torch.device) -> list[str]:
    """T_draft twice, as evaluate/draft_timing.py times it at evaluation (batch 1, context projected once)."""
    from dflash.model import DFlashDraftModel

    shape = SHAPES[args.drafter_shape]
    config = drafter_config(**{**shape, "hidden": args.hidden, "vocab": args.vocab})
    dtype = next(target.parameters()).dtype
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDraftModel(config).to(dtype).eval()
        features = torch.randn(args.context + 1, shape["layers"] * args.hidden, dtype=dtype)
        tokens = torch.randint(0, args.vocab, (args.context + 1,))
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    runner = BlockDrafter(drafter, embed, head, config.dflash_config["mask_token_id"]).to(device)
    runs = [drafter_step_ms(runner, features, tokens, args.context, args.repeats) for _ in range(2)]
    spread = [f"{run['min_ms']:.2f}..{run['max_ms']:.2f}" for run in runs]
    return [
        f"T_draft: drafter shape {args.drafter_shape} ({shape['layers']} layers, block {shape['block']}), "
        f"context {runs[0]['context_tokens']}, LM head over vocab {args.vocab}",
        "",
        "| | run 1 ms | min..max | run 2 ms | min..max | run 2 / run 1 |",
        "|---|---:|---|---:|---|---:|",
        f"| T_draft | {runs[0]['ms']:.2f} | {spread[0]} | {runs[1]['ms']:.2f} | {spread[1]} | "
        f"{runs[1]['ms'] / runs[0]['ms']:.3f} |",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
