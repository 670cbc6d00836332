"""The report's rows, one per drafter x dataset x method, from the metrics.json files (read by metrics_files.py).

They are what summary.csv holds (tidy, so that it can be filtered or plotted without knowing this module) and what
the tables and plots are drawn from: tau in both conventions with their intervals, the training step, the paired
difference to the reference and its verdict, and the expected speedup (an estimate, speedup/model.py) with its
source and the best DDTree budget by it; empty, with source "no profile", where no serving profile was there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from dflash_eval import stats
from dflash_eval.completions import prompt_cluster
from dflash_eval.errors import DflashEvalError
from dflash_eval.methods import REJECTION, TARGET_ONLY, chain_method, sort_key
from dflash_eval.report import speculation_profile
from dflash_eval.report.metrics_files import Evaluation, per_sample_steps
from dflash_eval.speedup import labels as speedup

COLUMNS = [
    "drafter",
    "dataset",
    "method",
    "primary",
    "block_size",
    "budget",
    "tau_mean_of_samples",
    "tau_token_weighted",
    "ci_low",
    "ci_high",
    "ci_low_tw",
    "ci_high_tw",
    "samples",
    "steps",
    "tokens",
    "training_step",
    "layer_ids",
    "backend",
    "backend_mismatch_allowed",
    "argmax_agreement",
    "tau_vs_reference",
    "diff_vs_reference",
    "diff_ci_low",
    "diff_ci_high",
    "verdict",
    # appended after the columns above (a reader of the earlier file keeps its columns and values)
    "expected_speedup",
    "speedup_source",
    "best_ddtree_budget",
]
# Appended only when an evaluation sampled: a greedy-only summary.csv keeps its columns and bytes.
SAMPLING_COLUMNS = [
    "scheme",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    # the rejection scheme's samples with a token outside dflash's support (evaluate/rejection.py)
    "outside_support_samples",
    "outside_support_share",
]
# Appended last: the evaluation's speculation profile (beside its metrics.json) and, on the own-chain rows of a
# training run's checkpoints, whether it is the run's best step and its paired difference to the runner-up
# (report/best_checkpoint.py); the columns before them keep their values.
HANDOFF_COLUMNS = [
    "speculation_profile",
    "best_step",
    "runner_up",
    "diff_vs_runner_up",
    "runner_up_ci_low",
    "runner_up_ci_high",
]


# -- the tidy table ------------------------------------------------------------------------------


def training_step(metrics: dict, spec: dict) -> int | None:
    """The checkpoint's own global_step is the truth; the config's step is the fallback."""
    checkpoint = metrics.get("checkpoint") or {}
    for step in (checkpoint.get("global_step"), spec.get("step"), checkpoint.get("step")):
        if step is not None:
            return int(step)
    return None


def _pair(values: Any) -> tuple[float, float]:
    if not isinstance(values, (list, tuple)) or len(values) != 2:
        return math.nan, math.nan
    return tuple(math.nan if v is None else float(v) for v in values)  # type: ignore[return-value]


def speedup_source(metrics: dict) -> str:
    """Who measured the profile behind an evaluation's expected speedup; "no profile" when it had none
    (also a metrics.json from before the estimate existed)."""
    section = metrics.get("speedup") or {}
    if not section.get("available"):
        return section.get("source") or speedup.NO_PROFILE
    return section.get("source") or "not recorded"


def best_ddtree_budget(metrics: dict) -> int | None:
    """The DDTree budget with the highest expected speedup (speedup/model.py chose it), None without one."""
    best = (metrics.get("speedup") or {}).get("best_ddtree") or {}
    return None if best.get("budget") is None else int(best["budget"])


def method_rows(evaluation: Evaluation, spec: dict) -> list[dict]:
    """One row per method of one evaluation: each chain block size and each DDTree budget."""
    metrics = evaluation.metrics
    cache = metrics["cache"]
    source, best = speedup_source(metrics), best_ddtree_budget(metrics)
    own_chain = chain_method(metrics["block_size"])
    methods = metrics.get("methods") or {own_chain: metrics["chain"]}
    agreement = metrics["diagnostics"].get("argmax_agreement")
    rows = []
    for method in sorted(methods, key=lambda name: method_order(name, evaluation.path)):
        numbers = methods[method]
        ci, ci_tw = _pair(numbers["ci95"].get("tau_mean_of_samples")), _pair(numbers["ci95"].get("tau_token_weighted"))
        rows.append(
            {
                "drafter": metrics["drafter"],
                "dataset": metrics["dataset"],
                "method": method,
                "primary": method == own_chain,
                "block_size": int(numbers.get("block_size", metrics["block_size"])),
                "budget": numbers.get("budget"),
                "tau_mean_of_samples": _float(numbers["tau_mean_of_samples"]),
                "tau_token_weighted": _float(numbers["tau_token_weighted"]),
                "ci_low": ci[0],
                "ci_high": ci[1],
                "ci_low_tw": ci_tw[0],
                "ci_high_tw": ci_tw[1],
                "samples": int(numbers["samples"]),
                "steps": int(numbers["steps"]),
                "tokens": int(numbers["tokens"]),
                "training_step": training_step(metrics, spec),
                "layer_ids": " ".join(str(i) for i in metrics["layer_ids"]),
                "backend": cache["backend"],
                "backend_mismatch_allowed": bool(cache["backend_mismatch_allowed"]),
                "argmax_agreement": _float(agreement),
                "tau_vs_reference": math.nan,
                "diff_vs_reference": math.nan,
                "diff_ci_low": math.nan,
                "diff_ci_high": math.nan,
                "verdict": "",
                "expected_speedup": _float(numbers.get("expected_speedup")),
                "speedup_source": source,
                "best_ddtree_budget": best,
                **sampling_fields(metrics, TARGET_ONLY),
                "speculation_profile": str(evaluation.path.with_name(speculation_profile.FILE)),
            }
        )
    return rows + rejection_rows(evaluation, spec)


def dataset_sampling(metrics: dict) -> dict:
    """The sampling parameters of an evaluation's completions: metrics.json lists the distinct sets it saw (one for
    a dataset fetched with one setting; None when greedy). Several sets have no single value: NaN."""
    found = metrics.get("sampling") or []
    found = [found] if isinstance(found, dict) else found
    if len(found) > 1:
        return {"temperature": math.nan, "top_p": math.nan, "top_k": None, "min_p": math.nan}
    return found[0] if found else {}


def sampling_fields(metrics: dict, scheme: str) -> dict:
    """The scheme and the dataset's sampling parameters of a row; greedy when metrics.json names none."""
    sampling = dataset_sampling(metrics)
    return {
        "scheme": scheme,
        "temperature": float(sampling.get("temperature", 0.0)),
        "top_p": _float(sampling.get("top_p")),
        "top_k": sampling.get("top_k"),
        "min_p": _float(sampling.get("min_p")),
    }


def rejection_rows(evaluation: Evaluation, spec: dict) -> list[dict]:
    """dflash_generate's scheme (evaluate/rejection_metrics.py): expected tau given each completion, one row per
    method it covers; its step count is an expectation, so `steps` is left empty."""
    metrics = evaluation.metrics
    section = metrics.get(REJECTION) or {}
    outside = section.get("outside_support") or {}
    rows = []
    for method, numbers in sorted((section.get("methods") or {}).items()):
        ci, ci_tw = _pair(numbers["ci95"].get("tau_mean_of_samples")), _pair(numbers["ci95"].get("tau_token_weighted"))
        rows.append(
            {
                "drafter": metrics["drafter"],
                "dataset": metrics["dataset"],
                "method": method,
                "primary": False,
                "block_size": int(numbers["block_size"]),
                "budget": None,
                "tau_mean_of_samples": _float(numbers["tau_mean_of_samples"]),
                "tau_token_weighted": _float(numbers["tau_token_weighted"]),
                "ci_low": ci[0],
                "ci_high": ci[1],
                "ci_low_tw": ci_tw[0],
                "ci_high_tw": ci_tw[1],
                "samples": int(numbers["samples"]),
                "steps": None,
                "tokens": int(numbers["tokens"]),
                "training_step": training_step(metrics, spec),
                "layer_ids": " ".join(str(i) for i in metrics["layer_ids"]),
                "backend": metrics["cache"]["backend"],
                "backend_mismatch_allowed": bool(metrics["cache"]["backend_mismatch_allowed"]),
                "argmax_agreement": math.nan,
                "tau_vs_reference": math.nan,
                "diff_vs_reference": math.nan,
                "diff_ci_low": math.nan,
                "diff_ci_high": math.nan,
                "verdict": "",
                "expected_speedup": math.nan,
                "speedup_source": "",
                "best_ddtree_budget": None,
                **sampling_fields(metrics, REJECTION),
                "outside_support_samples": outside.get("samples"),
                "outside_support_share": outside.get("share_of_samples"),
            }
        )
    return rows


def method_order(method: str, path: Path) -> tuple[int, int]:
    """methods.py's order (chains by block size, then DDTree by budget): metrics.json sorts keys as text
    (ddtree-16 < ddtree-8). A method this version does not know is an error naming the file."""
    try:
        return sort_key(method)
    except DflashEvalError as error:
        raise DflashEvalError(f"{path}: {error}") from None


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def add_verdicts(rows: list[dict], evaluations: list[Evaluation], settings: dict) -> None:
    """Paired difference to the reference drafter (same samples, same method) and its verdict."""
    reference = settings.get("reference")
    if reference is None:
        return
    steps = {e.key: per_sample_steps(e) for e in evaluations}
    sampled = {e.key[1] for e in evaluations if e.metrics.get("sampling")}  # the n draws of a prompt: one cluster
    for row in rows:
        if row["drafter"] == reference or row["scheme"] != TARGET_ONLY:  # samples.csv holds target_only steps
            continue
        mine = steps.get((row["drafter"], row["dataset"]), {})
        theirs = steps.get((reference, row["dataset"]), {})
        method = row["method"] if row["method"] in theirs else None
        if row["primary"]:  # own-block chains compare across block sizes, as in tau_vs_reference
            method = next(
                (
                    r["method"]
                    for r in rows
                    if r["drafter"] == reference and r["dataset"] == row["dataset"] and r["primary"]
                ),
                None,
            )
        if method is None or row["method"] not in mine:
            continue
        clusters = {i: prompt_cluster(i, True) for i in mine[row["method"]]} if row["dataset"] in sampled else None
        paired = stats.paired_difference(
            mine[row["method"]], theirs[method], settings["bootstrap"], settings["seed"], clusters=clusters
        )["tau_mean_of_samples"]
        row.update(
            diff_vs_reference=paired["difference"],
            diff_ci_low=paired["ci95"][0],
            diff_ci_high=paired["ci95"][1],
            verdict=stats.verdict(paired["ci95"]),
        )


def summary_rows(evaluations: list[Evaluation], settings: dict) -> list[dict]:
    """All rows in config order, with tau relative to the reference drafter when there is one."""
    rows = [row for e in evaluations for row in method_rows(e, settings["drafters"][e.key[0]])]
    add_verdicts(rows, evaluations, settings)
    reference = settings.get("reference")
    if reference is not None:
        baseline = {
            (r["dataset"], r["scheme"], _comparable(r)): r["tau_mean_of_samples"]
            for r in rows
            if r["drafter"] == reference
        }
        for row in rows:
            base = baseline.get((row["dataset"], row["scheme"], _comparable(row)), math.nan)
            row["tau_vs_reference"] = row["tau_mean_of_samples"] / base if base and not math.isnan(base) else math.nan
    return rows


def summary_frame(rows: list[dict]) -> pd.DataFrame:
    """The CSV's table; the nullable integer step keeps "1000" from becoming "1000.0"."""
    sampled = any(row["scheme"] != TARGET_ONLY or row["temperature"] != 0 for row in rows)  # NaN: several
    frame = pd.DataFrame(rows, columns=COLUMNS + (SAMPLING_COLUMNS if sampled else []) + HANDOFF_COLUMNS)
    for column in ("training_step", "steps", *(["top_k"] if sampled else [])):
        frame[column] = frame[column].astype("Int64")
    frame["budget"] = frame["budget"].astype("Int64")
    frame["best_ddtree_budget"] = frame["best_ddtree_budget"].astype("Int64")
    return frame


def _comparable(row: dict) -> str:
    """Own-block chains compare across block sizes (the drafter's block is part of what is compared)."""
    return "chain" if row["primary"] else row["method"]
