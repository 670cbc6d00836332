"""What checking every cache shard's sha256 costs an evaluation (cache.verify: hashed in the background as read).

Builds a hidden cache of `--samples` x `--tokens` tokens with 5 layers of `--hidden` bf16 states, then times,
alternating, `--repeats` times (page cache warm, as for the evaluations after the first of a cache):
- read: every sample through HiddenCache.load_sample (what an evaluation reads), no check;
- read+verify: the same with HiddenCache(verify=True) and its verified() at the end (what evaluate does);
- sha256: hashing every shard alone, on one thread.
A real evaluation spends far more time in the drafter than in reading, so "read" is the worst case: the
overhead there is the most verification can add. Prints a table and appends it to benchmarks/results/verify_cost.md.

    python benchmarks/verify_cost.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.cache.store import HiddenCache
from dflash_eval.cache.writer import CacheWriter
from dflash_eval.io_utils import sha256_file

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 16, 31, 46, 61]


def build(out: Path, samples: int, tokens: int, hidden: int, shard_tokens: int) -> None:
    header = {"target": {}, "backend": {"name": "torch"}, "device": "cpu", "completions": {}}
    with CacheWriter(out, layer_ids=LAYERS, shard_tokens=shard_tokens, store_argmax=True, header=header) as writer:
        for i in range(samples):
            states = {layer: torch.randn(tokens, hidden, dtype=torch.bfloat16) for layer in LAYERS}
            writer.add(f"s{i}", torch.arange(tokens), states, torch.arange(tokens), tokens // 4)
        writer.finish()


def read_all(out: Path, verify: bool) -> float:
    started = time.perf_counter()
    cache = HiddenCache(out, verify=verify)
    for sample in cache.samples:
        cache.load_sample(sample["id"]).features.sum()  # touch the rows, as a forward would
    cache.verified()
    return time.perf_counter() - started


def hash_all(out: Path) -> float:
    started = time.perf_counter()
    for shard in HiddenCache(out).manifest["shards"]:
        sha256_file(out / shard["file"])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    smoke_mode(parser, samples=2, tokens=16, hidden=32, shard_tokens=16, repeats=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cache"
        build(out, args.samples, args.tokens, args.hidden, args.shard_tokens)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        read_all(out, False)  # warm the page cache
        times: dict[str, list[float]] = {"read": [], "read+verify": [], "sha256": []}
        for _ in range(args.repeats):
            times["read"].append(read_all(out, False))
            times["read+verify"].append(read_all(out, True))
            times["sha256"].append(hash_all(out))
    median = {name: statistics.median(values) for name, values in times.items()}
    mb = size / 1e6
    title = (
        f"## verify_cost {time.strftime('%Y-%m-%d')}: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, {mb:.0f} MB cache ({args.samples} x {args.tokens} tokens, "
        f"5 layers x {args.hidden} bf16), {args.repeats} repeats, medians"
    )
    lines = [title, "", "| pass | seconds | MB/s | vs read |", "|---|---|---|---|"]
    for name, seconds in median.items():
        lines.append(f"| {name} | {seconds:.3f} | {mb / seconds:,.0f} | {seconds / median['read']:.2f}x |")
    lines.append("")
    lines.append(
        f"verification added {median['read+verify'] - median['read']:.3f} s to a pass that only reads "
        f"({100 * (median['read+verify'] / median['read'] - 1):.0f}%); sha256 alone runs at "
        f"{mb / median['sha256']:,.0f} MB/s on one thread"
    )
    print_and_record(lines, None if args.smoke else ROOT / "benchmarks" / "results" / "verify_cost.md")


if __name__ == "__main__":
    main()
