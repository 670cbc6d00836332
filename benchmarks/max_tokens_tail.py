"""The max_tokens tail: how often SGLang's full blocks and offline's shortened last block take different steps.

SGLang 0.5.23's DFlash worker drafts and verifies a full block even where the output will be cut at max_tokens,
then cuts it (demo/server.py says where); the reference loop and the offline evaluation shorten the block that
would run past max_tokens. The drafter is non-causal within a block, so a shortened block can accept a different
number of drafts, and the step counts can differ at the tail, not only the last step's drafts.

Per max_tokens, from each served prompt, greedy, on one device: the reference loop with B tokens to spare cut as
SGLang cuts (`sglang_steps`), against the loop run to exactly max_tokens (what offline computes: the fidelity
tests hold it equal to the evaluation step for step). It counts the requests cut at max_tokens, those whose step
counts differ, those whose accepted drafts differ, and any whose tokens differ (none should, greedy).

    python benchmarks/max_tokens_tail.py --target resources/demo/target --drafter resources/demo/drafters/step900 \\
        --completions results/completions/demo-code.jsonl --max-tokens 32 64 128 256

Prints the table and appends it to benchmarks/results/max_tokens_tail.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.completions import read_completions
from dflash_eval.demo.reference import run_reference_loop
from dflash_eval.demo.server import sglang_steps
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.stage import stop_token_ids
from dflash_eval.extract.backends import use_backend
from dflash_eval.extract.target import load_target

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "max_tokens_tail.md"


def tail_counts(drafter, target, prompts: list[list[int]], max_tokens: int, stops: list[int], block: int) -> dict:
    """Per request: SGLang's steps (full blocks, cut) against the shortened loop's, at this max_tokens."""
    counts = {
        "requests": len(prompts),
        "cut": 0,
        "steps_differ": 0,
        "drafts_differ": 0,
        "tokens_differ": 0,
        "tail_steps": 0,
    }
    for prompt in prompts:
        full_steps, full = run_reference_loop(drafter, target, prompt, max_tokens + block, stops, block_size=block)
        served = full[len(prompt) :][:max_tokens]
        sglang = sglang_steps(full_steps, len(served))
        short_steps, short = run_reference_loop(drafter, target, prompt, max_tokens, stops, block_size=block)
        if short[len(prompt) :] != served:
            counts["tokens_differ"] += 1
        if len(served) < max_tokens:
            continue  # stopped before the cut: both sides ran the same full blocks
        counts["cut"] += 1
        counts["tail_steps"] += len(sglang)
        if len(sglang) != len(short_steps):
            counts["steps_differ"] += 1
        if sum(sglang) - len(sglang) != sum(short_steps) - len(short_steps):
            counts["drafts_differ"] += 1
    return counts


def table(args: argparse.Namespace, rows: dict[int, dict], block: int, seconds: float) -> list[str]:
    lines = [
        f"## max_tokens_tail {time.strftime('%Y-%m-%d')}: {platform.node() or 'this machine'}, "
        f"torch {torch.__version__}, {args.device}, fp32, block {block}, greedy",
        "",
        f"`python benchmarks/max_tokens_tail.py {' '.join(sys.argv[1:])}` ({seconds:.0f} s)",
        "",
        "| max_tokens | requests | cut at max_tokens | step counts differ | accepted drafts differ | tokens differ |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for max_tokens, c in rows.items():
        lines.append(
            f"| {max_tokens} | {c['requests']} | {c['cut']} | {c['steps_differ']} | {c['drafts_differ']} "
            f"| {c['tokens_differ']} |"
        )
    return lines


def run(args: argparse.Namespace) -> None:
    records = read_completions(args.completions, need_tokens=True)[: args.limit]
    prompts = [record["prompt_token_ids"] for record in records]
    target, _ = load_target(args.target, "float32", args.device)
    drafter = load_drafter(args.drafter).model.to(device=target.device, dtype=torch.float32).eval()
    block = int(args.block or drafter.block_size)
    stops = stop_token_ids({"target": {"path": str(args.target)}})
    started = time.perf_counter()
    with use_backend(args.backend, args.device, target), torch.no_grad():
        rows = {
            max_tokens: tail_counts(drafter, target, prompts, max_tokens, stops, block)
            for max_tokens in args.max_tokens
        }
    print_and_record(table(args, rows, block, time.perf_counter() - started), args.record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    needed = "--smoke" not in sys.argv  # --smoke builds its own tiny inputs
    parser.add_argument("--target", type=Path, required=needed, help="the target's HF directory (the served one)")
    parser.add_argument("--drafter", type=Path, required=needed, help="the served drafter's directory")
    parser.add_argument("--completions", type=Path, required=needed, help="fetch's output: the prompts' ids")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--block", type=int, help="block size (default: the drafter's)")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch", choices=["fla", "torch"])
    parser.add_argument("--record", type=Path, default=RECORD)
    smoke_mode(parser, max_tokens=[6, 12], record=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from dflash_eval.testing.eval_project import tiny_served

            args.target, args.completions, args.drafter = tiny_served(Path(tmp))
        run(args)


if __name__ == "__main__":
    main()
