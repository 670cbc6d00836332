#!/usr/bin/env python3
"""Each job's wall time from Snakemake's benchmark files (every rule has `benchmark:`), as a markdown table.

    python3 .ci/rule_times.py [results/benchmarks]   # the GPU demo's per-rule table (benchmarks/results/gpu_demo.md)
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def job_times(root: Path) -> list[tuple[str, float, float]]:
    """(job, wall s, max RSS MB) per benchmark file under root, in file order."""
    rows = []
    for path in sorted(root.rglob("*.tsv")):
        with path.open() as handle:
            record = next(csv.DictReader(handle, delimiter="\t"), None)
        if record is None:
            continue
        rss = record.get("max_rss", "NA")
        rows.append((str(path.relative_to(root).with_suffix("")), float(record["s"]),
                     float(rss) if rss not in ("", "NA", "-") else float("nan")))
    return rows


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/benchmarks")
    rows = job_times(root)
    if not rows:
        print(f"no benchmark files under {root}", file=sys.stderr)
        return 1
    print("| job | wall s | max RSS MB |\n|---|---:|---:|")
    for job, seconds, rss in rows:
        print(f"| {job} | {seconds:.1f} | {rss:.0f} |")
    print(f"| sum of jobs | {sum(r[1] for r in rows):.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
