"""How the report shows numbers and drafters, the same in summary.md and on the plots.

No pandas or matplotlib here: the plot registry imports this at workflow load.
"""

from __future__ import annotations

import math
from typing import Any

DIGITS = 2  # tau precision shown; the CI is wider than 0.01 in practice


def missing(value: Any) -> bool:
    """None or NaN: a number the evaluation could not give (no samples, no CI)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt(value: Any, digits: int = DIGITS) -> str:
    return "n/a" if missing(value) else f"{value:.{digits}f}"


def drafter_label(drafter: str, settings: dict) -> str:
    return f"{drafter} (reference)" if drafter == settings.get("reference") else drafter


def samples(row: dict) -> bool:
    """Whether a row's completions were sampled (T > 0; NaN: several samplings, all sampled)."""
    return missing(row["temperature"]) or row["temperature"] > 0


HYPOTHETICAL_TREE = (
    "†: DDTree at T > 0 is hypothetical: SGLang 0.5.23 serves no DDTree, and the tree is built "
    "from the untempered drafter, each child accepted iff it is the served token (docs/sampling.md)."
)
