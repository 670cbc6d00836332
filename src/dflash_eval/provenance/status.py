"""`dflash-eval status`: which outputs older code made, read from their stamps, in one line.

With the code pinned (`--rerun-triggers mtime params input software-env`, docs/reruns.md) a code upgrade reruns
nothing, so the outputs made before it keep the stamps of the code that made them: this names them. A completions
file's stamp lies beside it (provenance.stamps.side_stamp_path); one made before that is named unstamped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_eval.provenance.identity import stage_identity
from dflash_eval.provenance.stamps import read_stamp, side_engine

# stage -> the stamped outputs under the results folder (workflow/rules/common.smk names the same paths)
STAMPED = {
    "fetch": "completions/*.jsonl",
    "extract": "hidden/*/*/manifest.json",
    "profile-target": "profile/*/*.json",
    "evaluate": "eval/*/*/metrics.json",
    "report": "trust.json",
}


def older_outputs(results: Path) -> tuple[int, dict[str, list[str]]]:
    """How many stamped outputs there are, and per stage those whose stamp is not this code's identity
    ("unstamped" for those made before stamps)."""
    older: dict[str, list[str]] = {}
    count = 0
    for stage, pattern in STAMPED.items():
        for path in sorted(results.glob(pattern)):
            count += 1
            current = stage_identity(stage, side_engine(path)) if stage == "fetch" else stage_identity(stage)
            stamp = read_stamp(path)
            if stamp != current:
                older.setdefault(stage if stamp else f"{stage} (unstamped)", []).append(
                    str(path.parent if stage == "extract" else path)
                )
    return count, older


def line(results: Path) -> str:
    count, older = older_outputs(results)
    if not count:
        return f"dflash-eval status: no stamped outputs under {results}/"
    if not older:
        return f"dflash-eval status: all {count} stamped outputs under {results}/ were made by this code"
    n = sum(len(paths) for paths in older.values())
    parts = "; ".join(f"{what}: {', '.join(paths)}" for what, paths in older.items())
    return f"dflash-eval status: {n} of {count} stamped outputs were made by older code ({parts})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-eval status [--results results]`."""
    parser.add_argument("--results", type=Path, default=Path("results"), help="the results folder (default results)")


def run(args: argparse.Namespace) -> int:
    print(line(args.results))
    return 0
