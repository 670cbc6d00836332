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
