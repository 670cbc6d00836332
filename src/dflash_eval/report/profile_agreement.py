"""Do the step profiles behind the expected speedups agree? One target on one device should cost the same per step
whichever dataset's extraction timed it; where two of them differ by more than 5%, the estimates made from them
cannot be ranked against each other, and the report says so.

Extraction compares a profile only with the one it replaces at the same path (extract/profile.py). Profiles of
the same target taken for different datasets are compared here. On one H200 the GPU demo's two extractions of the
same hybrid target, a few minutes apart, timed T_AR at 15.5 and 7.3 ms (eager timing beside other work;
benchmarks/results/gpu_demo.md): their speedup columns differed by that factor with no warning.

Only JSON is read (no torch). Profiles whose context lengths differ by more than CONTEXT_RATIO are not compared:
a longer context costs more per step, and that difference is real.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from dflash_eval.cache.serving_profile import PROFILE_NAME, load_profile
from dflash_eval.errors import DflashEvalError
from dflash_eval.report.summary import Evaluation

TOLERANCE = 0.05  # as extract/profile.py's comparison of a profile with the one it replaces
CONTEXT_RATIO = 1.25


def measured_profiles(evaluations: list[Evaluation]) -> list[dict[str, Any]]:
    """The extraction-measured profiles the evaluations' estimates used (a user's speedup.profile is one file for
    all, nothing to compare), one entry per file: where, which target on which device, T_AR and T_verify."""
    found: dict[str, dict[str, Any]] = {}
    for evaluation in evaluations:
        speedup = evaluation.metrics.get("speedup") or {}
        path = Path(str(evaluation.metrics["cache"]["dir"])) / PROFILE_NAME
        if str(path) in found or not str(speedup.get("target_source", "")).endswith(f"({path})"):
            continue
        try:
            profile = load_profile(path)
        except DflashEvalError:  # gone or replaced since the evaluation: nothing to compare
            continue
        found[str(path)] = {"path": str(path), "target": profile.get("target"), "device": profile.get("device"),
                            "method": profile.get("method"), "context_tokens": profile.get("context_tokens"),
                            "t_ar_ms": profile["t_ar_ms"],
                            "t_verify_ms": {int(n): ms for n, ms in profile["t_verify_ms"].items()}}
    return list(found.values())


def _comparable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["target"] is None or a["target"] != b["target"] or a["device"] != b["device"]:
        return False
    contexts = (a["context_tokens"], b["context_tokens"])
    return None in contexts or max(contexts) <= CONTEXT_RATIO * min(contexts)


def disagreements(profiles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs of profiles of one target on one device whose T_AR, or a T_verify size both measured, differ by more
    than TOLERANCE (the larger over the smaller), each with its worst size."""
    found = []
    for a, b in itertools.combinations(profiles, 2):
        if not _comparable(a, b):
            continue
        sizes = {"T_AR": (a["t_ar_ms"], b["t_ar_ms"])}
        sizes.update({f"T_verify({n})": (a["t_verify_ms"][n], b["t_verify_ms"][n])
                      for n in sorted(set(a["t_verify_ms"]) & set(b["t_verify_ms"]))})
        ratios = {name: max(x, y) / min(x, y) for name, (x, y) in sizes.items()}
        beyond = [name for name, ratio in ratios.items() if ratio > 1 + TOLERANCE]
        if beyond:
            worst = max(beyond, key=ratios.__getitem__)
            found.append({"target": a["target"], "device": a["device"], "paths": [a["path"], b["path"]],
                          "t_ar_ms": [a["t_ar_ms"], b["t_ar_ms"]], "worst": worst, "worst_ms": list(sizes[worst]),
                          "worst_ratio": ratios[worst], "sizes_beyond": beyond, "sizes_compared": len(ratios)})
    return found


def panel(evaluations: list[Evaluation]) -> dict[str, Any]:
    """trust.json's `serving_profiles`: the profiles compared and where they disagree."""
    profiles = measured_profiles(evaluations)
    return {"tolerance": TOLERANCE, "context_ratio": CONTEXT_RATIO,
            "profiles": [{k: v for k, v in p.items() if k != "t_verify_ms"} for p in profiles],
            "disagreements": disagreements(profiles)}


def warnings(section: dict[str, Any]) -> list[str]:
    """One markdown line per target and device whose profiles disagree (N datasets could make N(N-1)/2 pairs):
    the pair furthest apart, and how many pairs disagree where there are several."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for pair in section["disagreements"]:
        groups.setdefault((pair["target"], pair["device"]), []).append(pair)
    lines = []
    for (target, device), pairs in groups.items():
        d = max(pairs, key=lambda pair: pair["worst_ratio"])
        t_ar = sorted(p["t_ar_ms"] for p in section["profiles"] if (p["target"], p["device"]) == (target, device))
        several = (f" {len(pairs)} pairs of profiles disagree, T_AR {t_ar[0]:.3g}-{t_ar[-1]:.3g} ms across "
                   f"{len(t_ar)}; the furthest apart:" if len(pairs) > 1 else "")
        lines.append(
            f"**Step profiles disagree**: {target} on {device}:{several} {d['worst']} "
            f"{d['worst_ms'][0]:.3g} ms ({d['paths'][0]}) against {d['worst_ms'][1]:.3g} ms ({d['paths'][1]}), "
            f"{d['worst_ratio']:.2f}x apart ({len(d['sizes_beyond'])} of {d['sizes_compared']} sizes beyond "
            f"{section['tolerance']:.0%}; T_AR {d['t_ar_ms'][0]:.3g} / {d['t_ar_ms'][1]:.3g} ms). The expected "
            "speedups made from them cannot be ranked against each other: re-profile on an idle device (rerun "
            "those extractions), or measure the deployment once and name it as speedup.profile (docs/speedup.md).")
    return lines
