"""Timing one serving step: synchronised repeats until the median is known to ±2%, and whether a device is
worth timing.

The profile_target rule times the target with it (tools/target_timing.py), evaluation the drafter (evaluate/draft_timing.py).
A launch-bound HF step timed for a fixed time per size does not repeat between runs
(benchmarks/results/serving_profile.md), so a median is kept only once its 95% confidence interval
(distribution-free, stats.median_ci) lies within
`tolerance` of it, or the time cap stops it, which the result says (`stable: false`). `compare` says how
two measurements of the same target differ, size by size, and warns beyond 5%.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_eval.stats import median_ci

log = logging.getLogger(__name__)

TOLERANCE = 0.02  # the median's 95% CI within ±2% of it
MIN_REPEATS = 6  # the fewest for which a 95% median CI exists
AGREEMENT = 0.05  # two measurements of one step that differ by more than this are warned about


def wanted(options: dict[str, Any], device: torch.device) -> bool:
    """speedup.measure: true, false, or auto (CUDA only: a CPU step says nothing about serving)."""
    measure = options.get("measure", "auto")
    return measure is True or (measure == "auto" and device.type == "cuda")


def timed_ms(
    function: Callable[[], Any],
    device: torch.device,
    repeats: int,
    setup: Callable[[], Any] | None = None,
    budget_s: float | None = None,
    tolerance: float | None = TOLERANCE,
    max_repeats: int = 1000,
) -> dict[str, Any]:
    """Median ms of synchronised calls after one warm-up, with its spread and 95% CI; `setup` runs untimed
    before each call. At least `repeats` calls; then, with a `tolerance`, more until the CI of the median
    is within ±tolerance of it (`stable`), up to `max_repeats` or `budget_s` seconds (`capped` says which)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def once() -> float:
        if setup:
            setup()
        sync()
        start = time.perf_counter()
        function()
        sync()
        return 1e3 * (time.perf_counter() - start)

    once()  # warm-up
    began = time.perf_counter()
    times: list[float] = []
    least = max(int(repeats), MIN_REPEATS if tolerance is not None else 1)
    capped = None
    while True:
        times.append(once())
        if len(times) < least:
            if budget_s is not None and len(times) >= 3 and time.perf_counter() - began > budget_s:
                capped = f"time cap {budget_s:g} s"
                break
            continue
        median = statistics.median(times)
        low, high = median_ci(times)
        if tolerance is None or (median - low <= tolerance * median and high - median <= tolerance * median):
            break
        if len(times) >= max_repeats:
            capped = f"{max_repeats} repeats"
            break
        if budget_s is not None and time.perf_counter() - began > budget_s:
            capped = f"time cap {budget_s:g} s"
            break
    median = statistics.median(times)
    low, high = median_ci(times)
    stable = tolerance is not None and median - low <= tolerance * median and high - median <= tolerance * median
    return {
        "ms": median,
        "min_ms": min(times),
        "max_ms": max(times),
        "ci95_ms": [low, high],
        "repeats": len(times),
        "stable": stable,
        "capped": capped,
    }


def compare(previous: dict[str, float], current: dict[str, float], what: str) -> dict[str, Any]:
    """current / previous per size both measured; warns (and says so) where one differs by more than 5%."""
    ratios = {n: current[n] / previous[n] for n in current if n in previous and previous[n] > 0}
    apart = {n: r for n, r in ratios.items() if abs(r - 1) > AGREEMENT}
    if apart:
        worst = max(apart, key=lambda n: abs(apart[n] - 1))
        log.warning(
            "%s: %d of %d sizes differ from the previous measurement by more than %.0f%% (worst: %s "
            "tokens, %.3fx): the profile does not repeat; an estimate from it moves by as much",
            what,
            len(apart),
            len(ratios),
            100 * AGREEMENT,
            worst,
            apart[worst],
        )
    return {"ratios": ratios, "beyond_5_percent": sorted(apart, key=int), "agree": not apart}
