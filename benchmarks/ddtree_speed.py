"""DDTree scoring cost, before (full per-depth N x N beam) and after (truth-path pruning), vs the LM head.

One chunk of anchors: bf16 drafter logits [anchors, positions, vocab] and the true tokens. Two
synthetic distributions: `drafter-like` (random logits, the true token lifted by a margin that
shrinks with depth, so the truth is usually top-1 early and lost within a few depths, as for a
trained drafter) and `flat` (small logits, the true token only slightly ahead: long, wide trees,
the pruning's worst case). The LM head row is the matmul that produced such logits
([anchors x positions, hidden] x [hidden, vocab] in the logits' dtype). Every "after" result is
checked equal to the "before" one (with the path-order truth score; see dflash_eval/testing/ddtree_beam.py).

    python benchmarks/ddtree_speed.py --device cuda                       # H200: 256 x 15, vocab 248320
    python benchmarks/ddtree_speed.py --device cpu --anchors 32 --positions 7 --vocab 4096 --hidden 1024
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

ROOT = Path(__file__).resolve().parents[1]
from dflash_eval.evaluate.ddtree import tree_accepted
from dflash_eval.testing.ddtree_beam import beam_tree_accepted

BUDGET_SETS = {"8-64": [8, 16, 32, 64], "8-1024": [8, 16, 32, 64, 128, 256, 512, 1024]}


def synthetic(kind: str, anchors: int, positions: int, vocab: int, device: torch.device, seed: int = 0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    truth = torch.randint(0, vocab, (anchors, positions), generator=generator)
    if kind == "drafter-like":
        logits = torch.randn(anchors, positions, vocab, generator=generator) * 2.0
        margin = 12.0 - 0.6 * torch.arange(positions) + 3.0 * torch.randn(anchors, positions, generator=generator)
    else:
        logits = torch.randn(anchors, positions, vocab, generator=generator) * 0.3
        margin = 1.0 + 0.2 * torch.randn(anchors, positions, generator=generator)
    logits.scatter_add_(-1, truth[..., None], margin[..., None])
    return logits.to(device=device, dtype=torch.bfloat16), truth.to(device)


def timed(function, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds over `repeats` calls after one warm-up, and the last result."""
    result = function()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--positions", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--skip-before-above",
        type=int,
        default=1 << 30,
        help="skip the 'before' side for budget sets whose largest budget exceeds this",
    )
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/ddtree_speed.md")
    smoke_mode(parser, device="cpu", anchors=4, positions=3, vocab=200, hidden=32, repeats=1, record=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    hidden = torch.randn(args.anchors * args.positions, args.hidden, device=device, dtype=torch.bfloat16)
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=torch.bfloat16) / args.hidden**0.5
    head_s, _ = timed(lambda: hidden @ head.T, device, args.repeats)
    hidden = head = None  # free them before the scorer runs
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    lines = [
        (
            f"## DDTree scoring: {name}, torch {torch.__version__}, {args.anchors} anchors x {args.positions} "
            f"positions, vocab {args.vocab}, bf16 logits"
        ),
        "",
        f"LM head for these anchors (hidden {args.hidden}, bf16): {1e3 * head_s:.2f} ms",
        "",
        (
            "| logits | budgets | before ms | before / head | after ms | after / head | before / after | "
            "equal | mean depth at max budget |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for kind in ("drafter-like", "flat"):
        logits, truth = synthetic(kind, args.anchors, args.positions, args.vocab, device)
        for label, budgets in BUDGET_SETS.items():
            after_s, after = timed(lambda l=logits, t=truth, b=budgets: tree_accepted(l, t, b), device, args.repeats)
            if max(budgets) <= args.skip_before_above:
                before_s, before = timed(
                    lambda l=logits, t=truth, b=budgets: beam_tree_accepted(l, t, b), device, args.repeats
                )
                equal = "yes" if torch.equal(before, after) else "NO"
                before_cells = f"{1e3 * before_s:.1f} | {before_s / head_s:.2f} | "
                ratio = f"{before_s / after_s:.1f}"
            else:
                before_cells, equal, ratio = "skipped | | ", "", ""
            depth = float(after[-1].float().mean())
            lines.append(
                f"| {kind} | {label} | {before_cells}{1e3 * after_s:.1f} | {after_s / head_s:.2f} | "
                f"{ratio} | {equal} | {depth:.2f} |"
            )
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
