"""The expected speedup, made where tau, the drafter's own step time and the target's profile meet.

The estimate is arithmetic (tau x T_AR / (T_draft + T_verify(n)), an estimate of a server, not a measurement of
one: speedup/model.py; its labels speedup/labels.py). Its inputs come from two files made apart: each metrics.json
(tau per method, and `speedup.draft_timing`, the drafter's step timed at evaluation: evaluate/speedup.py), and
the target's profile (cache/serving_profile.py's format): the user's `speedup.profile`, or the one the
profile_target rule timed (tools/profile_target.py). The report and each export make it here, so a re-timed
target reruns neither an extraction nor an evaluation. A metrics.json's speedup section is replaced by the made
one, in memory: every table, plot and export reads it as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_eval.cache.serving_profile import ESTIMATE_STAMP, load_profile
from dflash_eval.speedup.labels import MEASURED, source_label
from dflash_eval.speedup.model import speedup_section
from dflash_eval.speedup.model import target_kind as kind_of

NOT_TIMED = "no target profile (speedup.measure false, or auto on a CPU, and no speedup.profile)"


def load_target_profile(path: str | Path | None, named_by_user: bool) -> tuple[dict | None, str, str | None]:
    """(the profile, where it came from, the estimate code that timed it) for `path`; (None, why, None) without
    one. A user's profile carries no stamp of ours (None); a measured one from before stamps says so."""
    if not path:
        return None, NOT_TIMED, None
    profile = load_profile(path)
    if named_by_user:
        return profile, f"user profile {path}", None
    method = profile.get("method")
    how = f", timed {method}" if method else ""
    if profile.get("verify_includes_state_commit"):
        how += ", each verify with its Gated DeltaNet state commit"
    stamp = profile.get(ESTIMATE_STAMP) or "unstamped (timed before stamps)"
    return profile, f"measured by the profile_target rule on {profile.get('device', '?')}{how} ({path})", stamp


def estimate(
    methods: dict[str, dict],
    target: dict | None,
    target_source: str,
    named_by_user: bool,
    timing: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `speedup` section (and each method's expected_speedup) for one evaluation's `methods`.

    T_draft comes from the target profile when it gives one (a user's `t_draft_ms`: one value for every block and
    budget), else from `timing`, the drafter's step timed at evaluation at each block size and DDTree budget its
    methods draft ({"by_block": {b: timing}, "by_budget": {N: timing}, "device", "context_tokens", "method"}; None
    where speedup.measure said not to)."""
    target_kind = None if target is None else kind_of(target, named_by_user)
    draft_ms, tree_ms, draft_kind = None, None, None
    if target is not None and target.get("t_draft_ms") is not None:
        draft_ms, draft_source, draft_kind = target["t_draft_ms"], target_source, target_kind
        timing = None
    elif target is None:
        timing = None
    if timing is not None:
        draft_ms, draft_kind = {int(b): t["ms"] for b, t in timing["by_block"].items()}, MEASURED
        tree_ms = {int(n): t["ms"] for n, t in (timing.get("by_budget") or {}).items()}
        spread = ", ".join(
            [f"b{b} {t['ms']:.3g} ({t['min_ms']:.3g}..{t['max_ms']:.3g})" for b, t in timing["by_block"].items()]
            + [
                f"ddtree-{n} {t['ms']:.3g} ({t['min_ms']:.3g}..{t['max_ms']:.3g})"
                for n, t in (timing.get("by_budget") or {}).items()
            ]
        )
        draft_source = (
            f"timed at evaluation on {timing['device']} ({timing.get('method', 'eager')}), context "
            f"{timing['context_tokens']}, per block with the step's context projection (a DDTree's "
            f"with its top-N, read and tree build), median ms (min..max): {spread}"
        )
        if target is not None and target.get("method") == "eager" and timing.get("method") not in (None, "eager"):
            draft_source += (
                " (the target profile was timed eagerly and the drafter step with CUDA graphs: the two "
                "terms were timed two ways)"
            )
    if draft_ms is None:
        draft_source = (
            "not timed (speedup.measure false, or auto on a CPU; no t_draft_ms in the profile)"
            if target
            else "not timed"
        )
    section = speedup_section(methods, target, target_source, draft_ms, draft_source, tree_ms)
    if draft_kind is None and target is not None and target.get("t_step_ms"):
        draft_kind = target_kind  # the profile's whole steps stand in for T_draft + T_verify at their blocks
    section["source"] = source_label(target_kind, draft_kind)
    if timing is not None:
        section["draft_timing"] = timing
    return section


def apply(
    metrics: dict[str, Any], target: dict | None, target_source: str, named_by_user: bool, profile_stamp: str | None
) -> dict[str, Any]:
    """Replace `metrics`' speedup section (what evaluation wrote: the drafter's timing and its estimate-code stamp)
    with the estimate made from it and the target profile; each method's expected_speedup with it. The section's
    estimate_code names both codes: the evaluation's and the profile's (None for a user's profile)."""
    written = metrics.get("speedup") or {}
    section = estimate(metrics.get("methods") or {}, target, target_source, named_by_user, written.get("draft_timing"))
    stamps = written.get("estimate_code") or {}
    section["estimate_code"] = {"evaluation": stamps.get("evaluation"), "profile": profile_stamp}
    metrics["speedup"] = section
    chain = metrics.get("chain") or {}
    if chain.get("method") in (metrics.get("methods") or {}):  # a copy of its method's entry in the file
        chain["expected_speedup"] = metrics["methods"][chain["method"]]["expected_speedup"]
    return metrics
