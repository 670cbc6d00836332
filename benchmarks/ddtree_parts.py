"""Where DDTree scoring's time goes over a large vocabulary, and the two forms of its top log-probs side by side.

ddtree_speed.py times the scorer whole; this times its parts on one chunk of synthetic bf16 logits (its
`drafter-like` and `flat` kinds): the float32 copy, the log-softmax, the top-k of float32 log-probs against
the top-k of the bf16 logits, and the scorer with its top log-probs taken either way ("log-probs then top-k":
the form before 92cb142; "top-k of the logits, log-probs gathered": ddtree.truth_path_ranks), plus a loop
without host reads (tried: every depth at full width, no compaction). Every form's result is checked equal
to the scorer's. Prints a table and appends it to benchmarks/results/ddtree_parts.md.

    python3 benchmarks/ddtree_parts.py --device cuda                   # H200: 64 and 256 anchors x 15, vocab 248320
    python benchmarks/ddtree_parts.py --device cpu --anchors 32 --vocab 4096
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from ddtree_speed import synthetic, timed  # benchmarks/ (the script's own folder)
from record import print_and_record, smoke_mode

from dflash_eval.evaluate.ddtree import (
    better_node_counts,
    better_node_counts_on_device,
    tree_accepted,
    truth_path_ranks,
)

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = [8, 16, 32, 64]


def ranks_of_log_probs(logits: torch.Tensor, truth: torch.Tensor, width: int):
    """The form before: a float32 copy, its log-softmax, a top-k of the log-probs."""
    values, indices = torch.topk(torch.log_softmax(logits.float(), dim=-1), width, dim=-1)
    match = indices == truth[..., None]
    exists = (match.any(dim=-1) & (truth >= 0)).to(torch.int64).cumprod(dim=-1).bool()
    step = torch.where(match, values, torch.zeros_like(values)).sum(dim=-1)
    scores, total = [], torch.zeros_like(step[:, 0])
    for depth in range(step.shape[1]):
        total = total + step[:, depth]
        scores.append(total)
    return values, exists, torch.stack(scores, dim=1)


def counts_without_host_reads(values: torch.Tensor, truth_score: torch.Tensor, exists: torch.Tensor, budget: int):
    """better_node_counts at full width at every depth: no compaction, so no host read (the evaluator's lever,
    `tree_accepted(host_reads=False)`)."""
    return better_node_counts_on_device(values, truth_score, exists, budget)


def scorer(logits: torch.Tensor, truth: torch.Tensor, ranks, counts) -> torch.Tensor:
    values, exists, truth_score = ranks(logits, truth, min(max(BUDGETS), logits.shape[-1]))
    better = counts(values, truth_score, exists, max(BUDGETS))
    return torch.stack([(exists & (better < b)).to(torch.int64).cumprod(dim=-1).sum(dim=-1) for b in BUDGETS])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--anchors", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--positions", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/ddtree_parts.md")
    smoke_mode(parser, device="cpu", anchors=[4], positions=3, vocab=200, repeats=1, record=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"## DDTree parts: {name}, torch {torch.__version__}, {args.positions} positions, vocab {args.vocab}, "
        f"bf16 logits, budgets 8-64 (median ms of {args.repeats})",
        "",
        "| logits | anchors | part | ms | equal to the scorer |",
        "|---|---:|---|---:|---|",
    ]
    for anchors in args.anchors:
        for kind in ("drafter-like", "flat"):
            logits, truth = synthetic(kind, anchors, args.positions, args.vocab, device)
            expected = tree_accepted(logits, truth, BUDGETS)
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            parts = [
                ("float32 copy", lambda: logits.float(), None),
                ("log-softmax of the float32 copy", lambda: torch.log_softmax(logits.float(), dim=-1), None),
                (
                    "log-softmax reading bf16, float32 out",
                    lambda: torch.log_softmax(logits, -1, dtype=torch.float32),
                    None,
                ),
                ("top-64 of float32 log-probs", lambda: torch.topk(log_probs, 64, dim=-1), None),
                ("top-64 of bf16 logits", lambda: torch.topk(logits, 64, dim=-1), None),
                (
                    "scorer: log-probs then top-k",
                    lambda: scorer(logits, truth, ranks_of_log_probs, better_node_counts),
                    True,
                ),
                (
                    "scorer: top-k of the logits, log-probs gathered (kept)",
                    lambda: scorer(logits, truth, truth_path_ranks, better_node_counts),
                    True,
                ),
                (
                    "scorer: kept ranks, loop without host reads (tried)",
                    lambda: scorer(logits, truth, truth_path_ranks, counts_without_host_reads),
                    True,
                ),
            ]
            for label, function, check in parts:
                seconds, result = timed(function, device, args.repeats)
                equal = ("yes" if torch.equal(result, expected) else "NO") if check else ""
                lines.append(f"| {kind} | {anchors} | {label} | {1e3 * seconds:.2f} | {equal} |")
                print(lines[-1], flush=True)
            same_bits = torch.equal(torch.log_softmax(logits, -1, dtype=torch.float32), log_probs)
            lines.append(
                f"| {kind} | {anchors} | log-softmax reading bf16 = of the float32 copy, bit for bit | | "
                f"{'yes' if same_bits else 'NO'} |"
            )
            logits = log_probs = None  # freed before the next chunk
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
