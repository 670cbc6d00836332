"""Two ways to write each of the trajectory evaluator's passes over large score or logit tensors, side by side.

- attention masking (packed.py): `scores.masked_fill_(hidden, -inf)` against `scores.add_(bias)` with a 0/-inf
  bias of the mask's shape (broadcast over the heads); identical on finite scores;
- top-k ranks (trajectory.py): `(logits > score).sum(-1)` (the bool sum first copies every flag to int64) against
  `(logits > score).view(torch.uint8).sum(-1, dtype=torch.int32)`; identical counts.
Shapes default to the demo's largest forward (59 slots, 2 key heads x 2 groups, 59 queries, 221 keys; 143
blocks x 7 draft positions x 4096 tokens). Median of --repeats timings after a warm call; checks each pair is
equal. Prints a table and appends it to benchmarks/results/score_ops.md.

    python benchmarks/score_ops.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from record import print_and_record, smoke_mode

ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/score_ops.md")
    smoke_mode(parser, repeats=2, record=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(53, 2, 2, 59, 221, generator=generator)
    hidden = torch.rand(53, 1, 1, 59, 221, generator=generator) > 0.5
    bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    assert torch.equal(scores.clone().masked_fill_(hidden, float("-inf")), scores.clone().add_(bias))
    logits = torch.randn(143, 7, 4096, generator=generator)
    score = logits[..., 3:4].clone()
    assert torch.equal((logits > score).sum(-1), (logits > score).view(torch.uint8).sum(-1, dtype=torch.int32).long())
    work = scores.clone()
    rows = [
        (
            "attention mask",
            list(scores.shape),
            "masked_fill_(mask, -inf)",
            median_ms(lambda: work.masked_fill_(hidden, float("-inf")), args.repeats),
            "add_(0/-inf bias)",
            median_ms(lambda: work.add_(bias), args.repeats),
        ),
        (
            "top-k rank",
            list(logits.shape),
            "(logits > score).sum(-1)",
            median_ms(lambda: (logits > score).sum(-1), args.repeats),
            "... .view(uint8).sum(-1, dtype=int32)",
            median_ms(lambda: (logits > score).view(torch.uint8).sum(-1, dtype=torch.int32), args.repeats),
        ),
    ]
    lines = [
        f"## score ops: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, fp32, "
        f"torch {torch.__version__}, median of {args.repeats}",
        "",
        "| pass | shape | before | ms | now | ms | x |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for name, shape, before, before_ms, now, now_ms in rows:
        lines.append(
            f"| {name} | {shape} | `{before}` | {before_ms:.2f} | `{now}` | {now_ms:.2f} | {before_ms / now_ms:.1f} |"
        )
    print_and_record(lines, args.record)


if __name__ == "__main__":
    main()
