"""The report's inputs, read and checked: exactly one metrics.json per configured drafter x dataset, in config
order, each with the fields the report needs and the layer list the config names, and the per-sample steps of
the samples.csv beside it. An error names the file and what to run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object
from dflash_eval.methods import chain_method

log = logging.getLogger(__name__)


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
