"""The independent reference: `dflash.model.dflash_generate` run live, and near-tie forensics."""

from __future__ import annotations

import time

import torch


def online_acceptance(drafter, target, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]):
    """Run the reference online loop (temperature 0); returns (acceptance_lengths, output ids)."""
    import dflash.model as reference

    original = reference._cuda_time
    reference._cuda_time = time.perf_counter  # the reference synchronises CUDA for its timers
    try:
        stats = reference.dflash_generate(drafter, target, torch.tensor([prompt_ids]), max_new_tokens,
                                          stop_ids, temperature=0.0, return_stats=True)
    finally:
        reference._cuda_time = original
    return list(stats.acceptance_lengths), stats.output_ids[0].tolist()


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
