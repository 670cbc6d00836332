"""Timing one serving step: the median of synchronised repeats, and whether a device is worth timing.

Extraction times the target with it (extract/profile.py), evaluation the drafter (evaluate/draft_timing.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def wanted(options: dict[str, Any], device: torch.device) -> bool:
    """speedup.measure: true, false, or auto (CUDA only: a CPU step says nothing about serving)."""
    measure = options.get("measure", "auto")
    return measure is True or (measure == "auto" and device.type == "cuda")


def timed_ms(function: Callable[[], Any], device: torch.device, repeats: int,
             setup: Callable[[], Any] | None = None, budget_s: float | None = None) -> dict[str, float]:
    """Median and spread (min, max) in ms of `repeats` calls after one warm-up, synchronised;
    `setup` runs untimed before each call; past `budget_s` seconds it stops after 3 repeats."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: list[float] = []
    began = time.perf_counter()
    for _ in range(repeats + 1):
        if budget_s is not None and len(times) > 3 and time.perf_counter() - began > budget_s:
            break
        if setup:
            setup()
        sync()
        start = time.perf_counter()
        function()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    times = times[1:]  # the first call warms up
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
