"""Expected speedup of each method from tau and a cost profile of one serving step: an estimate.

A speculative step drafts a block (T_draft) and has the target verify n tokens (T_verify(n), n per
method: methods.py's `verified_tokens`, b for a chain block of b, N + 1 under a tree mask for a DDTree
of N nodes); it yields tau tokens, where plain decoding yields one per T_AR. So

    expected speedup = tau x T_AR / (T_draft + T_verify(n))

with tau token-weighted (tokens / steps, the bonus token included: throughput counts every token).
It is a model of a server, not a measurement of one: batch 1, no scheduling or sampling overhead,
and the profile's own kernels (a tuned server such as SGLang uses CUDA graphs and its own kernels).
The profile is a checked serving_profile.json (cache/serving_profile.py), already loaded.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_eval import methods
from dflash_eval.speedup.labels import FORMULA, TAU_CONVENTION


def verify_ms(profile: dict[str, Any], tokens: int) -> float | None:
    """T_verify(tokens): the profile's value, linear between its two neighbours, None outside its range."""
    table = profile["t_verify_ms"]
    if tokens in table:
        return table[tokens]
    below = [n for n in table if n < tokens]
    above = [n for n in table if n > tokens]
    if not below or not above:
        return None
    low, high = max(below), min(above)
    return table[low] + (table[high] - table[low]) * (tokens - low) / (high - low)


def expected_speedup(tau: float, t_ar_ms: float, t_draft_ms: float, t_verify_ms: float) -> float:
    return tau * t_ar_ms / (t_draft_ms + t_verify_ms)


def speedup_section(by_method: dict[str, dict], target: dict[str, Any] | None, target_source: str,
                    t_draft_ms: float | None, draft_source: str) -> dict[str, Any]:
    """Adds `expected_speedup` to each method (None where it cannot be estimated) and returns
    metrics.json's `speedup` section: the inputs, their sources and the best DDTree budget."""
    for stats in by_method.values():
        stats["expected_speedup"] = None
    if target is None or t_draft_ms is None:
        why = "no target profile" if target is None else "no drafter step time"
        return {"estimate": True, "available": False, "why": f"{why} ({target_source}; {draft_source})"}
    verify, outside = {}, []
    for name, stats in by_method.items():
        tokens = methods.verified_tokens(name)
        t_verify = verify_ms(target, tokens)
        if t_verify is None:
            outside.append(name)
            continue
        tau = stats.get("tau_token_weighted")
        verify[name] = {"tokens": tokens, "t_verify_ms": t_verify}
        if tau is not None and not math.isnan(tau):
            stats["expected_speedup"] = expected_speedup(float(tau), target["t_ar_ms"], t_draft_ms, t_verify)
    trees = [(s["expected_speedup"], methods.parse(name).budget, name) for name, s in by_method.items()
             if methods.is_kind(name, methods.TREE.name) and s["expected_speedup"] is not None]
    best = max(trees, key=lambda t: (t[0], -t[1])) if trees else None
    return {
        "estimate": True, "available": True, "formula": FORMULA, "tau": TAU_CONVENTION,
        "target_source": target_source, "draft_source": draft_source,
        "context_tokens": target.get("context_tokens"), "t_ar_ms": target["t_ar_ms"], "t_draft_ms": t_draft_ms,
        "verify": verify, "outside_profile": outside,
        "best_ddtree": None if best is None else {"method": best[2], "budget": best[1], "expected_speedup": best[0]},
    }
