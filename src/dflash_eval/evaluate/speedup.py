"""The evaluate stage's part of the expected speedup: the drafter's own step, timed at the sizes its methods draft.

The estimate itself is made in the report (report/speedup.py), from this section of metrics.json, tau and the
target's profile (timed once, by the profile_target rule): evaluation reads no target profile, so a re-timed
target reruns no evaluation. The drafter is timed whenever speedup.measure says so on the evaluation's device
(a user profile's t_draft_ms, where it has one, wins in the report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_eval import methods as method_names
from dflash_eval.methods import chain_method
from dflash_eval.provenance.identity import estimate_code_hash


def projections(methods: dict[str, dict]) -> dict[int, int]:
    """Block size -> the context rows a drafter step at it projects: the tokens a step commits, round(tau)
    of that block's chain (1 where it has none); every block some method drafts."""
    blocks: dict[int, int] = {}
    for name, stats in methods.items():
        block = stats.get("block_size")
        if block is None:
            continue
        tau = stats.get("tau_token_weighted") if name == chain_method(int(block)) else None
        rows = max(1, round(tau)) if tau is not None and tau == tau else 1
        blocks[int(block)] = max(blocks.get(int(block), 1), rows)
    return dict(sorted(blocks.items()))


def tree_projections(methods: dict[str, dict]) -> dict[int, int]:
    """DDTree budget -> the context rows its drafting step projects: round(tau) of that DDTree (1 where unknown)."""
    trees: dict[int, int] = {}
    for name, stats in methods.items():
        budget = method_names.parse(name).budget
        if budget is not None:
            tau = stats.get("tau_token_weighted")
            trees[int(budget)] = max(1, round(tau)) if tau is not None and tau == tau else 1
    return dict(sorted(trees.items()))


def drafter_section(
    methods: dict[str, dict], time_drafter: Callable[[dict[int, int], dict[int, int]], dict[str, Any] | None]
) -> dict[str, Any]:
    """metrics.json's `speedup` section as evaluation writes it: `draft_timing`, `time_drafter(projections(methods),
    tree_projections(methods))` ({"by_block": {b: timing}, "by_budget": {N: timing}, "device", "context_tokens",
    "method"}; None where speedup.measure says not to), and the estimate code that timed it."""
    return {
        "estimate": True,
        "made_in": "the report, from this section, tau and the target profile",
        "draft_timing": time_drafter(projections(methods), tree_projections(methods)),
        "estimate_code": {"evaluation": estimate_code_hash()},
    }
