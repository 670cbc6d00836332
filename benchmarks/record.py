"""Shared by the benchmarks: print a result table and append it to its record under benchmarks/results/."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def print_and_record(lines: list[str], record: Path | None) -> None:
    """Print the table; append it to `record` unless that is None (a smoke run records nothing)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if record is None:
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a", encoding="utf-8") as handle:
        handle.write(text + "\n")


def smoke_mode(parser: argparse.ArgumentParser, argv: list[str] | None = None, **tiny) -> None:
    """Add `--smoke`: the script's own code path on tiny CPU values `tiny` (new defaults, so an explicit
    argument still wins), recording nothing. Call before `parse_args`; `args.smoke` tells the script."""
    parser.add_argument("--smoke", action="store_true", help="seconds on a tiny CPU shape; records nothing")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**tiny)


def checkout_commit(root: Path) -> str | None:
    """The checkout's short HEAD, with "+changes" where tracked files differ from it: a copied work tree (the GPU
    machine's) can sit on an older .git, and a record must not name a commit whose code it did not run."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
