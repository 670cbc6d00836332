"""The evaluate stage's expected speedup: which profile it uses, when it times the drafter, the section it writes.

The estimate itself (tau x T_AR / (T_draft + T_verify(n)), an estimate of a server, not a measurement
of one) is speedup/model.py's; its labels speedup/labels.py's. The profile (its file format and checks: cache/serving_profile.py) is the user's `speedup.profile`
when set, else the one extraction measured beside the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_eval import methods as method_names
from dflash_eval.cache.serving_profile import PROFILE_NAME, load_profile
from dflash_eval.methods import chain_method
from dflash_eval.speedup.labels import MEASURED, source_label
from dflash_eval.speedup.model import speedup_section
from dflash_eval.speedup.model import target_kind as kind_of


def profiles_for(settings: dict[str, Any], hidden: str | Path) -> tuple[dict | None, str]:
    """The target profile to use and where it came from: the user's file wins over the measured one."""
    options = settings.get("speedup") or {}
    if options.get("profile"):
        return load_profile(options["profile"]), f"user profile {options['profile']}"
    measured = Path(hidden) / PROFILE_NAME
    if measured.is_file():
        profile = load_profile(measured)
        method = profile.get("method")
        how = f", timed {method}" if method else ""
        if profile.get("verify_includes_state_commit"):
            how += ", each verify with its Gated DeltaNet state commit"
        return profile, f"measured at extraction on {profile.get('device', '?')}{how} ({measured})"
    return None, f"no {PROFILE_NAME} beside the cache and no speedup.profile"


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


def estimate(settings: dict[str, Any], hidden: str | Path, methods: dict[str, dict],
             time_drafter: Callable[[dict[int, int], dict[int, int], str | None], dict[str, Any] | None]
             ) -> dict[str, Any]:
    """metrics.json's `speedup` section (and each method's expected_speedup) for one evaluation.

    T_draft comes from the user's profile when it gives one (one value for every block and budget), else
    `time_drafter(projections(methods), tree_projections(methods), the target profile's method)` times the step at
    each block size and DDTree budget the methods draft, the way the target was timed ({"by_block": {b: timing},
    "by_budget": {N: timing}, "device", "context_tokens", "method"}; None where speedup.measure says not to)."""
    target, target_source = profiles_for(settings, hidden)
    target_kind = None if target is None else kind_of(target, bool((settings.get("speedup") or {}).get("profile")))
    timing, draft_ms, tree_ms, draft_kind = None, None, None, None
    if target is not None and target.get("t_draft_ms") is not None:
        draft_ms, draft_source, draft_kind = target["t_draft_ms"], target_source, target_kind
    elif target is not None:
        # None where speedup.measure says not to
        timing = time_drafter(projections(methods), tree_projections(methods), target.get("method"))
    if timing is not None:
        draft_ms, draft_kind = {int(b): t["ms"] for b, t in timing["by_block"].items()}, MEASURED
        tree_ms = {int(n): t["ms"] for n, t in (timing.get("by_budget") or {}).items()}
        spread = ", ".join([f"b{b} {t['ms']:.3g} ({t['min_ms']:.3g}..{t['max_ms']:.3g})"
                            for b, t in timing["by_block"].items()] +
                           [f"ddtree-{n} {t['ms']:.3g} ({t['min_ms']:.3g}..{t['max_ms']:.3g})"
                            for n, t in (timing.get("by_budget") or {}).items()])
        draft_source = (f"timed at evaluation on {timing['device']} ({timing.get('method', 'eager')}), context "
                        f"{timing['context_tokens']}, per block with the step's context projection (a DDTree's "
                        f"with its top-N, read and tree build), median ms (min..max): {spread}")
    if draft_ms is None:
        draft_source = ("not timed (speedup.measure false, or auto on a CPU; no t_draft_ms in the profile)"
                        if target else "not timed")
    section = speedup_section(methods, target, target_source, draft_ms, draft_source, tree_ms)
    if draft_kind is None and target is not None and target.get("t_step_ms"):
        draft_kind = target_kind  # the profile's whole steps stand in for T_draft + T_verify at their blocks
    section["source"] = source_label(target_kind, draft_kind)
    if timing is not None:
        section["draft_timing"] = timing
    return section
