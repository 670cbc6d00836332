"""Every drafter x dataset metrics.json, checked, into the report's rows: one per drafter x dataset x method.

The rows are what summary.csv holds (tidy, so that it can be filtered or plotted without knowing
this module) and what the markdown tables and plots are drawn from: tau in both conventions with
their intervals, the training step, the paired difference to the reference drafter and its verdict,
and the expected speedup (an estimate, speedup/model.py) with its source and the evaluation's best
DDTree budget by it; empty, with source "no profile", where no serving profile was there to use.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dflash_eval import stats
from dflash_eval.completions import prompt_cluster
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object
from dflash_eval.methods import chain_method, sort_key
from dflash_eval.report import speculation_profile
from dflash_eval.speedup import labels as speedup

log = logging.getLogger(__name__)

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
# Appended only when an evaluation sampled (issue 25): a greedy-only summary.csv keeps its columns and bytes.
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


@dataclass(frozen=True)
class Evaluation:
    """One metrics.json and the file it came from (named in every error about it)."""

    path: Path
    metrics: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.metrics["drafter"], self.metrics["dataset"]


# -- reading and checking ------------------------------------------------------------------------

REQUIRED = (
    "drafter",
    "dataset",
    "block_size",
    "layer_ids",
    "checkpoint",
    "cache.backend",
    "cache.backend_mismatch_allowed",
    "chain.tau_mean_of_samples",
    "chain.tau_token_weighted",
    "chain.samples",
    "chain.steps",
    "chain.tokens",
    "chain.ci95",
    "diagnostics",
)


def ordered_settings(settings: dict) -> dict:
    """Drafters in config order: the settings JSON sorts keys, `drafter_order` keeps the user's order."""
    drafters = settings.get("drafters") or {}
    listed = [n for n in settings.get("drafter_order") or [] if n in drafters]
    return {
        **settings,
        "drafters": {name: drafters[name] for name in listed + [n for n in drafters if n not in listed]},
    }


def check_settings(settings: dict) -> None:
    """The settings must name something to report, and a reference that is one of the drafters."""
    if not settings.get("drafters") or not settings.get("datasets"):
        raise DflashEvalError("report settings name no drafters or no datasets: nothing to report")
    reference = settings.get("reference")
    if reference is not None and reference not in settings["drafters"]:
        raise DflashEvalError(
            f"report reference {reference!r} is not one of the drafters: {', '.join(settings['drafters'])}"
        )
    served = settings.get("served_drafter")
    if served is not None and served not in settings["drafters"]:
        raise DflashEvalError(
            f"report served_drafter {served!r} is not one of the drafters: {', '.join(settings['drafters'])}"
        )


def _lookup(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            raise KeyError(dotted)
        data = data[part]
    return data


def read_metrics(path: str | Path) -> Evaluation:
    """Load one metrics.json, failing with its name when it is absent, not JSON or lacks a field."""
    path = Path(path)
    if not path.is_file():
        raise DflashEvalError(f"metrics file {path} not found; run the evaluate stage for it first")
    metrics = read_json_object(path)
    for field in REQUIRED:
        try:
            _lookup(metrics, field)
        except KeyError:
            raise DflashEvalError(
                f"{path}: no {field!r}; is it a metrics.json written by `dflash-eval evaluate`?"
            ) from None
    return Evaluation(path=path, metrics=metrics)


def collect(settings: dict, paths: Iterable[str | Path]) -> list[Evaluation]:
    """Exactly one evaluation per configured drafter x dataset, in config order."""
    paths = list(paths)
    absent = [str(p) for p in paths if not Path(p).is_file()]
    if absent:
        raise DflashEvalError(f"metrics file(s) not found: {', '.join(absent)}; run the evaluate stage for them first")
    found: dict[tuple[str, str], Evaluation] = {}
    for path in paths:
        evaluation = read_metrics(path)
        if evaluation.key in found:
            raise DflashEvalError(
                f"{found[evaluation.key].path} and {path} both hold drafter "
                f"{evaluation.key[0]!r} on dataset {evaluation.key[1]!r}; pass one"
            )
        found[evaluation.key] = evaluation
    ordered = [
        _expected(found, drafter, dataset) for drafter in settings["drafters"] for dataset in settings["datasets"]
    ]
    for key in sorted(set(found) - {e.key for e in ordered}):
        log.warning("%s: drafter %r on dataset %r is not in the config; left out of the report", found[key].path, *key)
    for evaluation in ordered:
        _check_layers(evaluation, settings["drafters"][evaluation.key[0]])
    return ordered


def _expected(found: dict[tuple[str, str], Evaluation], drafter: str, dataset: str) -> Evaluation:
    if (drafter, dataset) not in found:
        raise DflashEvalError(
            f"no metrics for drafter {drafter!r} on dataset {dataset!r} among the --metrics files "
            f"(expected e.g. results/eval/{drafter}/{dataset}/metrics.json); run the evaluate stage for it"
        )
    return found[(drafter, dataset)]


def _check_layers(evaluation: Evaluation, spec: dict) -> None:
    """A metrics file from another layer list is stale: reporting it would mislabel the number."""
    expected = spec.get("layer_ids")
    actual = list(evaluation.metrics["layer_ids"])
    if expected is not None and list(expected) != actual:
        raise DflashEvalError(
            f"{evaluation.path}: evaluated with layer ids {actual} but the config says "
            f"{list(expected)} for drafter {evaluation.key[0]!r}; re-run its evaluation"
        )


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
                **sampling_fields(metrics, "target_only"),
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
    section = metrics.get("rejection") or {}
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
                **sampling_fields(metrics, "rejection"),
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


def per_sample_steps(evaluation: Evaluation) -> dict[str, dict[str, list[int]]]:
    """method -> sample id -> acceptance lengths, from the samples.csv written beside metrics.json."""
    path = evaluation.path.with_name("samples.csv")
    if not path.is_file():
        raise DflashEvalError(f"{path} not found; the paired comparison needs the evaluate stage's per-sample rows")
    frame = pd.read_csv(path, dtype={"id": str, "acceptance_lengths": str}, keep_default_na=False)
    if "method" not in frame:
        frame["method"] = chain_method(evaluation.metrics["block_size"])
    out: dict[str, dict[str, list[int]]] = {}
    for row in frame.itertuples(index=False):
        out.setdefault(row.method, {})[row.id] = [int(x) for x in str(row.acceptance_lengths).split()]
    return out


def add_verdicts(rows: list[dict], evaluations: list[Evaluation], settings: dict) -> None:
    """Paired difference to the reference drafter (same samples, same method) and its verdict."""
    reference = settings.get("reference")
    if reference is None:
        return
    steps = {e.key: per_sample_steps(e) for e in evaluations}
    sampled = {e.key[1] for e in evaluations if e.metrics.get("sampling")}  # the n draws of a prompt: one cluster
    for row in rows:
        if row["drafter"] == reference or row["scheme"] != "target_only":  # samples.csv holds target_only steps
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
    sampled = any(row["scheme"] != "target_only" or row["temperature"] != 0 for row in rows)  # NaN: several
    frame = pd.DataFrame(rows, columns=COLUMNS + (SAMPLING_COLUMNS if sampled else []) + HANDOFF_COLUMNS)
    for column in ("training_step", "steps", *(["top_k"] if sampled else [])):
        frame[column] = frame[column].astype("Int64")
    frame["budget"] = frame["budget"].astype("Int64")
    frame["best_ddtree_budget"] = frame["best_ddtree_budget"].astype("Int64")
    return frame


def _comparable(row: dict) -> str:
    """Own-block chains compare across block sizes (the drafter's block is part of what is compared)."""
    return "chain" if row["primary"] else row["method"]
