"""Shared by the benchmarks: print a result table and append it to its record under benchmarks/results/."""

from __future__ import annotations

from pathlib import Path


def print_and_record(lines: list[str], record: Path) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a", encoding="utf-8") as handle:
        handle.write(text + "\n")
