"""Expected speedup of each method from tau and a cost profile of one serving step: an estimate.

A speculative step drafts a block (T_draft) and has the target verify n tokens (T_verify(n): a
chain block of b verifies b tokens, a DDTree of N nodes N + 1 under a tree mask); it yields tau
tokens, where plain decoding yields one per T_AR. So

    expected speedup = tau x T_AR / (T_draft + T_verify(n))

with tau token-weighted (tokens / steps, the bonus token included: throughput counts every token).
It is a model of a server, not a measurement of one: batch 1, no scheduling or sampling overhead,
and the profile's own kernels (a tuned server such as SGLang uses CUDA graphs and its own kernels).

The profile (its file format and checks: cache/serving_profile.py) is the user's `speedup.profile`
when set, else the one extraction measured beside the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_eval.cache.serving_profile import PROFILE_NAME, load_profile

FORMULA = "tau_token_weighted x T_AR / (T_draft + T_verify(n))"
TAU_CONVENTION = "token-weighted tau (tokens / verification steps, the bonus token included)"
# the `source` of an estimate, short (summary.csv's speedup_source): who measured the target's and the drafter's step
USER, MEASURED = "user profile", "measured by us"
NO_PROFILE, NO_DRAFT_TIME = "no profile", "no drafter step time"


def source_label(target: str | None, draft: str | None) -> str:
    """USER or MEASURED for each step (None: not known): one label, the same wherever it is shown."""
    if target is None:
        return NO_PROFILE
    if draft is None:
        return NO_DRAFT_TIME
    return target if target == draft else f"{target}; drafter step {draft}"


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


def verified_tokens(method: dict[str, Any]) -> int:
    """Tokens the target verifies per step: b for chain-B<b>, N + 1 (the root) for DDTree-N."""
    return int(method["budget"]) + 1 if method["kind"] == "ddtree" else int(method["block_size"])


def expected_speedup(tau: float, t_ar_ms: float, t_draft_ms: float, t_verify_ms: float) -> float:
    return tau * t_ar_ms / (t_draft_ms + t_verify_ms)


def speedup_section(methods: dict[str, dict], target: dict[str, Any] | None, target_source: str,
                    t_draft_ms: float | None, draft_source: str) -> dict[str, Any]:
    """Adds `expected_speedup` to each method (None where it cannot be estimated) and returns
    metrics.json's `speedup` section: the inputs, their sources and the best DDTree budget."""
    for stats in methods.values():
        stats["expected_speedup"] = None
    if target is None or t_draft_ms is None:
        why = "no target profile" if target is None else "no drafter step time"
        return {"estimate": True, "available": False, "why": f"{why} ({target_source}; {draft_source})"}
    verify, outside = {}, []
    for name, stats in methods.items():
        tokens = verified_tokens(stats)
        t_verify = verify_ms(target, tokens)
        if t_verify is None:
            outside.append(name)
            continue
        tau = stats.get("tau_token_weighted")
        verify[name] = {"tokens": tokens, "t_verify_ms": t_verify}
        if tau is not None and not math.isnan(tau):
            stats["expected_speedup"] = expected_speedup(float(tau), target["t_ar_ms"], t_draft_ms, t_verify)
    trees = [(s["expected_speedup"], s["budget"], name) for name, s in methods.items()
             if s["kind"] == "ddtree" and s["expected_speedup"] is not None]
    best = max(trees, key=lambda t: (t[0], -t[1])) if trees else None
    return {
        "estimate": True, "available": True, "formula": FORMULA, "tau": TAU_CONVENTION,
        "target_source": target_source, "draft_source": draft_source,
        "context_tokens": target.get("context_tokens"), "t_ar_ms": target["t_ar_ms"], "t_draft_ms": t_draft_ms,
        "verify": verify, "outside_profile": outside,
        "best_ddtree": None if best is None else {"method": best[2], "budget": best[1], "expected_speedup": best[0]},
    }


def profiles_for(settings: dict[str, Any], hidden: str | Path) -> tuple[dict | None, str]:
    """The target profile to use and where it came from: the user's file wins over the measured one."""
    options = settings.get("speedup") or {}
    if options.get("profile"):
        return load_profile(options["profile"]), f"user profile {options['profile']}"
    measured = Path(hidden) / PROFILE_NAME
    if measured.is_file():
        profile = load_profile(measured)
        return profile, f"measured at extraction on {profile.get('device', '?')} ({measured})"
    return None, f"no {PROFILE_NAME} beside the cache and no speedup.profile"


def estimate(settings: dict[str, Any], hidden: str | Path, methods: dict[str, dict],
             time_drafter: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's `speedup` section (and each method's expected_speedup) for one evaluation.

    T_draft comes from the user's profile when it gives one, else `time_drafter()` measures it
    (it returns None where speedup.measure says not to)."""
    target, target_source = profiles_for(settings, hidden)
    target_kind = None if target is None else USER if (settings.get("speedup") or {}).get("profile") else MEASURED
    timing, draft_ms, draft_kind = None, None, None
    if target is not None and target.get("t_draft_ms") is not None:
        draft_ms, draft_source, draft_kind = target["t_draft_ms"], target_source, target_kind
    elif target is not None:
        timing = time_drafter()  # None where speedup.measure says not to
    if timing is not None:
        draft_ms, draft_kind = timing["ms"], MEASURED
        draft_source = (f"timed at evaluation on {timing['device']}, context {timing['context_tokens']}, "
                        f"median ({timing['min_ms']:.3g}..{timing['max_ms']:.3g} ms)")
    if draft_ms is None:
        draft_source = ("not timed (speedup.measure false, or auto on a CPU; no t_draft_ms in the profile)"
                        if target else "not timed")
    section = speedup_section(methods, target, target_source, draft_ms, draft_source)
    section["source"] = source_label(target_kind, draft_kind)
    if timing is not None:
        section["draft_timing"] = timing
    return section
