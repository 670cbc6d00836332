"""Time a dry run of 100 checkpoints x 5 datasets (goal: <= 10 s on 2 cores).

The checkpoints are one training-run directory of 100 `step_N.pt` files (expanded to 100 drafters),
so the run also measures the directory expansion and the content fingerprints: the first dry run
hashes every checkpoint, later ones read the fingerprint cache (keyed by path, size and mtime).
Nothing is executed: the plan covers 5 fetch + 5 extract + 500 evaluate + 1 report jobs. Also
reports the load average, because the machine it ran on may be shared. Appends to
benchmarks/results/dryrun_scale.md.

    python benchmarks/dryrun_scale.py [--checkpoints 100] [--datasets 5] [--checkpoint-mb 8] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import tempfile
import time
from pathlib import Path

from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

ROOT = Path(__file__).resolve().parents[1]
from dflash_eval.provenance.fingerprint import DEFAULT_CACHE
from dflash_eval.testing.workflow import (
    check,
    copy_workflow,
    load_config,
    save_config,
    snakemake,
    tiny_project,
    write_bytes,
)


def build(root: Path, checkpoints: int, datasets: int, checkpoint_mb: float) -> None:
    tiny_project(root, drafters=0, datasets=datasets)
    (root / "target" / "config.json").write_text('{"num_hidden_layers": 64}')  # the layer ids below must exist
    config = load_config(root)
    run = root / "ckpt" / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"block_size": 16}')
    for i in range(checkpoints):
        write_bytes(run / f"step_{(i + 1) * 1000}.pt", int(checkpoint_mb * 2**20), seed=i)
    config["drafters"] = {"run": {"path": "ckpt/run", "layer_ids": [1, 16, 31, 46, 61], "trained_with": "torch"}}
    save_config(root, config)


def timed_dry_run(workflow: Path, root: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + sys of the snakemake process) and planned jobs of one dry run.

    A fresh interpreter, as a user's command line: Snakemake's own start-up counts. The CPU time is
    the number that a shared, overloaded machine does not inflate much.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    text = check(snakemake(workflow, root, "--dry-run", fresh=True))
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    total = int(re.search(r"^total\s+(\d+)", text, re.M).group(1))
    return seconds, cpu, total


def cached_files(root: Path) -> int:
    """Files in the fingerprint cache that the dry runs share (.snakemake/dflash-eval/)."""
    return len(json.loads((root / DEFAULT_CACHE).read_text())["files"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=100)
    parser.add_argument("--datasets", type=int, default=5)
    parser.add_argument("--checkpoint-mb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="what else ran on the machine, CPU throttling, ...")
    smoke_mode(parser, checkpoints=2, datasets=1, checkpoint_mb=0.01, repeats=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workflow = copy_workflow(Path(tmp) / "workflow", ROOT)
        root = Path(tmp) / "project"
        build(root, args.checkpoints, args.datasets, args.checkpoint_mb)
        load_before = os.getloadavg()[0]
        cold, cold_cpu, jobs = timed_dry_run(workflow, root)
        entries = cached_files(root)
        warm = [timed_dry_run(workflow, root)[:2] for _ in range(args.repeats)]
        load_after = os.getloadavg()[0]
    walls, cpus = sorted(w for w, _ in warm), sorted(c for _, c in warm)  # each column on its own
    best, median = (walls[0], cpus[0]), (walls[len(walls) // 2], cpus[len(cpus) // 2])
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.checkpoints} checkpoints x {args.datasets} datasets,"
        f" {jobs} planned jobs, {os.cpu_count()} CPUs",
        "",
        "| dry run | wall s | CPU s |",
        "|---|---|---|",
        f"| first (hashes {args.checkpoints} x {args.checkpoint_mb:g} MB checkpoints) | {cold:.1f} | {cold_cpu:.1f} |",
        f"| cached fingerprints ({entries} files), best of {args.repeats} | {best[0]:.1f} | {best[1]:.1f} |",
        f"| cached fingerprints, median of {args.repeats} | {median[0]:.1f} | {median[1]:.1f} |",
        "",
        f"Load average (1 min) before/after: {load_before:.1f} / {load_after:.1f}. {args.note}".rstrip(),
    ]
    print_and_record(lines, None if args.smoke else ROOT / "benchmarks" / "results" / "dryrun_scale.md")


if __name__ == "__main__":
    main()
