"""Expected speedup of each method from tau and a cost profile of one serving step: an estimate.

    expected speedup = tau x T_AR / (T_draft + T_verify(n))

with tau token-weighted and n the tokens the method verifies (methods.py's `verified_tokens`). It models a server
(batch 1, the profile's own kernels), it does not measure one. The profile is a checked serving_profile.json
(cache/serving_profile.py). Only measured sizes count: a size the profile does not list gives no estimate and says
why (`not_measured`), never an interpolated value; a DDTree step on a hybrid target is priced as a causal pass
and says so. Why each rule: docs/speedup.md.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_eval import methods
from dflash_eval.speedup.labels import (
    FORMULA,
    MEASURED,
    TAU_CONVENTION,
    USER,
    USER_SGLANG,
)

HYBRID_TREE_NOTE = (
    "DDTree on this Gated DeltaNet hybrid target is priced as a causal pass of N + 1 tokens: "
    "such a target cannot verify a tree in one causal pass (its recurrent state is per branch), "
    "and as of SGLang 0.5.23 no engine we know verifies trees on GDN hybrids; an upper bound on "
    "what a tree could give there, not a served configuration"
)


def target_kind(profile: dict[str, Any], named_by_user: bool) -> str:
    """Who measured a target profile: the user (their `speedup.profile`; USER_SGLANG when dflash-eval profile-server
    measured it on their SGLang, its `engine: sglang`) or us at extraction (MEASURED)."""
    if not named_by_user:
        return MEASURED
    return USER_SGLANG if profile.get("engine") == "sglang" else USER


def verify_ms(profile: dict[str, Any], tokens: int) -> float | None:
    """T_verify(tokens): the profile's measured value, None where it has none (never interpolated)."""
    return profile["t_verify_ms"].get(int(tokens))


def expected_speedup(tau: float, t_ar_ms: float, t_draft_ms: float, t_verify_ms: float) -> float:
    return tau * t_ar_ms / (t_draft_ms + t_verify_ms)


def draft_ms(t_draft_ms: float | dict[int, float], block: int) -> float | None:
    """T_draft at a block size: one value for every block (a user profile's t_draft_ms), or the one timed at it."""
    return t_draft_ms.get(int(block)) if isinstance(t_draft_ms, dict) else t_draft_ms


def speedup_section(
    by_method: dict[str, dict],
    target: dict[str, Any] | None,
    target_source: str,
    t_draft_ms: float | dict[int, float] | None,
    draft_source: str,
    t_tree_draft_ms: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Adds `expected_speedup` to each method (None where it cannot be estimated) and returns
    metrics.json's `speedup` section: the inputs, their sources and the best DDTree budget.

    `t_draft_ms` is one value, or one per drafted block size (each method drafts its `block_size`:
    b for chain-B<b>, the drafter's own block for a DDTree). `t_tree_draft_ms` (budget N -> ms) is a DDTree's
    whole drafting step where it was timed: the drafter's block, the top-N of its positions, their read, the
    tree's build and upload (evaluate/draft_timing.py); a DDTree without one is priced at its block's T_draft."""
    for stats in by_method.values():
        stats["expected_speedup"] = None
    if target is None or (t_draft_ms is None and not target.get("t_step_ms")):
        why = "no target profile" if target is None else "no drafter step time"
        return {"estimate": True, "available": False, "why": f"{why} ({target_source}; {draft_source})"}
    verify, not_measured = {}, {}
    steps = target.get("t_step_ms") or {}
    for name, stats in by_method.items():
        tokens, block = methods.verified_tokens(name), stats.get("block_size")
        tau = stats.get("tau_token_weighted")
        if methods.is_kind(name, methods.CHAIN.name) and int(tokens) in steps:  # a whole step, measured on a server
            verify[name] = {"tokens": tokens, "t_step_ms": steps[int(tokens)], "block_size": block}
            if tau is not None and not math.isnan(tau):
                stats["expected_speedup"] = float(tau) * target["t_ar_ms"] / steps[int(tokens)]
            continue
        if t_draft_ms is None:
            not_measured[name] = "no drafter step time and no t_step_ms at this block"
            continue
        t_verify = verify_ms(target, tokens)
        budget = methods.parse(name).budget
        tree_step = budget is not None and int(budget) in (t_tree_draft_ms or {})
        if tree_step:
            t_draft = t_tree_draft_ms[int(budget)]
        else:
            t_draft = draft_ms(t_draft_ms, block) if block is not None or not isinstance(t_draft_ms, dict) else None
        if t_verify is None or t_draft is None:
            not_measured[name] = (
                f"{tokens} verified tokens: not in the profile"
                if t_verify is None
                else f"the drafter step at block {block} was not timed"
            )
            continue
        verify[name] = {
            "tokens": tokens,
            "t_verify_ms": t_verify,
            "block_size": block,
            "t_draft_ms": t_draft,
            **({"t_draft_step": "DDTree drafting step (block, top-N, read, tree build)"} if tree_step else {}),
        }
        if tau is not None and not math.isnan(tau):
            stats["expected_speedup"] = expected_speedup(float(tau), target["t_ar_ms"], t_draft, t_verify)
    trees = [
        (s["expected_speedup"], methods.parse(name).budget, name)
        for name, s in by_method.items()
        if methods.is_kind(name, methods.TREE.name) and s["expected_speedup"] is not None
    ]
    best = max(trees, key=lambda t: (t[0], -t[1])) if trees else None
    trees_priced = any(methods.is_kind(name, methods.TREE.name) for name in verify)
    return {
        "estimate": True,
        "available": True,
        "formula": FORMULA,
        "tau": TAU_CONVENTION,
        "ddtree_note": HYBRID_TREE_NOTE if target.get("hybrid") and trees_priced else None,
        "target_source": target_source,
        "draft_source": draft_source,
        "context_tokens": target.get("context_tokens"),
        "t_ar_ms": target["t_ar_ms"],
        "t_draft_ms": t_draft_ms,
        "verify": verify,
        "not_measured": {name: f"{why} (sizes are measured, never interpolated)" for name, why in not_measured.items()},
        "best_ddtree": None if best is None else {"method": best[2], "budget": best[1], "expected_speedup": best[0]},
    }
