"""summary.md's expected-speedup section: the estimate per method, the best DDTree budget, and what each estimate
was made from, with how far such estimates were measured to be from a real speedup (docs/speedup.md)."""

from __future__ import annotations

from typing import Any

from dflash_eval.methods import tree_method, verified_legend
from dflash_eval.report.labels import DIGITS, drafter_label, fmt, missing, samples
from dflash_eval.report.md_table import table_row
from dflash_eval.report.metrics_files import Evaluation
from dflash_eval.report.tau_section import method_grid
from dflash_eval.speedup import labels as speedup
from dflash_eval.speedup import validation

SPEEDUP_INTRO = (
    f"Expected speedup (estimate) = {speedup.FORMULA}, with n = {verified_legend()}, T_AR the target's one-token decode step, T_draft the drafter's block forward with the LM head "
    "(batch 1). tau here is the token-weighted one (tokens / steps, the bonus token included). It is a model of one "
    "serving step from a cost profile, not a measured throughput. Source: **user profile** (`speedup.profile`, "
    "measured on your deployment: the one to decide with) or **measured by us** (the target timed at extraction, "
    "the drafter step at evaluation, batch 1: on CUDA, as CUDA graphs over a static cache (and static Gated DeltaNet "
    "states for a hybrid) where the target's architecture supports it, else HF transformers' eager forward, "
    "launch-bound on a GPU, so not a tuned server's; serving_profile.json names the method; docs/speedup.md). "
    '"Made from" below says how far such estimates were measured to be from a real speedup. **Bold**: best in '
    "its column."
)


_UNESTIMATED = (speedup.NO_PROFILE, speedup.NO_DRAFT_TIME)  # an evaluation's source when it has no estimate at all


def _speedup_text(value: Any) -> str:
    return f"{value:.{DIGITS}f}×"


def _speedup_cell(row: dict | None, best: float | None) -> str:
    """The estimate; where there is none, why: the evaluation's source ("no profile") or n/a (a size not measured: the caveats below say which)."""
    if row is None:
        return "–"
    value = row["expected_speedup"]
    if missing(value):
        return row["speedup_source"] if row["speedup_source"] in _UNESTIMATED else "n/a"
    text = _speedup_text(value)
    return f"**{text}**" if best is not None and round(value, DIGITS) == best else text


def best_budget_table(rows: list[dict], settings: dict) -> list[str]:
    """Per drafter x dataset: the DDTree budget with the highest expected speedup, beside the own chain's."""
    header = [
        "drafter",
        "dataset",
        "best DDTree budget",
        "expected speedup (estimate)",
        "tau (token-weighted)",
        "own chain expected speedup (estimate)",
        "source",
    ]
    lines = [table_row(header), table_row(["---", "---", "---:", "---:", "---:", "---:", "---"])]
    for drafter in settings["drafters"]:
        for dataset in settings["datasets"]:
            mine = [r for r in rows if r["drafter"] == drafter and r["dataset"] == dataset]
            if not mine:
                continue
            chain = next((r for r in mine if r["primary"]), None)
            budget = mine[0]["best_ddtree_budget"]
            tree = None if missing(budget) else next((r for r in mine if r["method"] == tree_method(int(budget))), None)
            own = "–" if chain is None else _speedup_cell(chain, None)
            if tree is None:
                lines.append(
                    table_row(
                        [drafter_label(drafter, settings), dataset, "–", "–", "–", own, mine[0]["speedup_source"]]
                    )
                )
                continue
            lines.append(
                table_row(
                    [
                        drafter_label(drafter, settings),
                        dataset,
                        f"**{int(budget)}**" + (" †" if samples(tree) else ""),
                        _speedup_text(tree["expected_speedup"]),
                        fmt(tree["tau_token_weighted"]),
                        own,
                        tree["speedup_source"],
                    ]
                )
            )
    return lines


def speedup_sources(evaluations: list[Evaluation]) -> list[str]:
    """What each estimate was made from (the profiles' files and the drafter timings), identical ones together."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for evaluation in evaluations:
        section = evaluation.metrics.get("speedup") or {}
        if not section.get("available"):
            continue
        key = (str(section.get("target_source")), str(section.get("draft_source")))
        grouped.setdefault(key, []).append("{} on {}".format(*evaluation.key))
    lines = [
        f"- target step: {target}; drafter step: {draft} ({', '.join(names)})"
        for (target, draft), names in grouped.items()
    ]
    return lines + speedup_caveats(evaluations) + validation_lines(evaluations)


def estimate_sources(evaluations: list[Evaluation]) -> list[str]:
    """The sources the evaluations' estimates were made from (each part of a "target; drafter step" label)."""
    sources: list[str] = []
    for evaluation in evaluations:
        section = evaluation.metrics.get("speedup") or {}
        if section.get("available"):
            for source in str(section.get("source")).split("; drafter step "):
                if source not in sources:
                    sources.append(source)
    return sources


def estimate_stamps(evaluations: list[Evaluation]) -> dict[str, list[dict[str, Any]]]:
    """Per estimate source shown, the estimate-code stamps of the evaluations behind it (metrics.json's
    speedup.estimate_code: the evaluation's and its measured profile's; {} where it has none, made before stamps)."""
    stamps: dict[str, list[dict[str, Any]]] = {source: [] for source in estimate_sources(evaluations)}
    for evaluation in evaluations:
        section = evaluation.metrics.get("speedup") or {}
        if section.get("available"):
            for source in str(section.get("source")).split("; drafter step "):
                stamps[source].append(section.get("estimate_code") or {})
    return stamps


def validation_lines(evaluations: list[Evaluation]) -> list[str]:
    """Per estimate source shown, how far such estimates were measured to be from a real speedup, and whether
    that was the estimate code that made these numbers, by their stamps (speedup/validation.py:
    benchmarks/speedup_validation.py's record)."""
    entries = validation.load()
    return [
        f"- {validation.describe(source, entries, made_by)}" for source, made_by in estimate_stamps(evaluations).items()
    ]


def speedup_caveats(evaluations: list[Evaluation]) -> list[str]:
    """What an estimate leaves out or assumes: methods whose sizes were not measured, DDTree on a hybrid."""
    notes: dict[str, list[str]] = {}
    for evaluation in evaluations:
        section = evaluation.metrics.get("speedup") or {}
        where = "{} on {}".format(*evaluation.key)
        for method, why in (section.get("not_measured") or {}).items():
            notes.setdefault(f"no estimate for {method}: {why}", []).append(where)
        if section.get("ddtree_note"):
            notes.setdefault(section["ddtree_note"], []).append(where)
    return [f"- {note} ({', '.join(names)})" for note, names in notes.items()]


def speedup_lines(rows: list[dict], evaluations: list[Evaluation], settings: dict) -> list[str]:
    """The section: the estimate per method and the best DDTree budget, or why there is none."""
    lines = ["## Expected speedup (an estimate)", ""]
    if all(missing(r["expected_speedup"]) for r in rows):
        reasons = sorted({r["speedup_source"] for r in rows})
        return lines + [
            f"No expected speedup ({', '.join(reasons)}): it needs a serving profile. Name one measured on your "
            "deployment as `speedup.profile` in config.yaml, or extract on a CUDA device (`speedup.measure: auto`, "
            "the default, times the target there and the drafter step at evaluation; on a CPU nothing is timed: a "
            "CPU step says nothing about serving). summary.csv leaves `expected_speedup` empty.",
            "",
        ]
    lines += [SPEEDUP_INTRO, ""]
    lines += method_grid(rows, settings, "expected_speedup", _speedup_cell) + [""]
    lines += [
        "### Best DDTree budget by expected speedup",
        "",
        "tau keeps rising with the budget while a tree of N nodes costs the target N + 1 tokens to verify: the "
        "fastest budget is where the two balance (under this profile).",
        "",
    ]
    lines += best_budget_table(rows, settings) + [""]
    lines += ["Made from:", ""] + speedup_sources(evaluations) + [""]
    return lines
