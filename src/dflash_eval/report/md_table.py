"""One row of a markdown table, with its cells escaped: the primitive of every table in summary.md."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"
