"""The report stage: every drafter x dataset metrics.json into one CSV, one markdown page and plots.

summary.csv is tidy (one row per drafter x dataset x method) so that it can be filtered or plotted
without knowing this module; summary.md is for people: tau with its confidence interval, the best
per column in bold, and a Diagnostics section that makes a suspect number (kernel backend mismatch,
low argmax agreement, skipped samples) impossible to miss.

This module reads only JSON and writes text and PNG: it imports neither torch nor transformers, so
the report reruns in a second even on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from dflash_eval.evaluate import acceptance
from dflash_eval.report import plots
from dflash_eval.report import online as online_check, trust
from dflash_eval.config import report_settings, settings_from_args
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json, atomic_write_text
from dflash_eval.report.plots import drafter_label as _drafter_label, fmt as _fmt, missing as _missing

log = logging.getLogger(__name__)

COLUMNS = [
    "drafter", "dataset", "method", "primary", "block_size", "budget", "tau_mean_of_samples", "tau_token_weighted",
    "ci_low", "ci_high", "ci_low_tw", "ci_high_tw", "samples", "steps", "tokens", "training_step",
    "layer_ids", "backend", "backend_mismatch_allowed", "argmax_agreement", "tau_vs_reference",
    "diff_vs_reference", "diff_ci_low", "diff_ci_high", "verdict",
]
DIGITS = plots.DIGITS
LOW_AGREEMENT = 0.95                 # below this the cached target is likely not the one that served
MAX_LISTED_SKIPS = 5


@dataclass(frozen=True)
class Evaluation:
    """One metrics.json and the file it came from (named in every error about it)."""

    path: Path
    metrics: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.metrics["drafter"], self.metrics["dataset"]


# -- command line ---------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", help="report settings as JSON (what the workflow passes)")
    parser.add_argument("--config", help="config.yaml, to run by hand")
    parser.add_argument("--metrics", nargs="+", required=True, help="metrics.json of every drafter x dataset")
    parser.add_argument("--hidden", nargs="*", default=[],
                        help="hidden-state cache directories, for the trust panel (default: each metrics' cache dir)")
    parser.add_argument("--completions", nargs="*", default=[],
                        help="completions JSONL per dataset (results/completions/{dataset}.jsonl), for the trust panel")
    parser.add_argument("--transitions", help="the server hook's transitions.jsonl (default: from the settings)")
    parser.add_argument("--csv", required=True, help="output tidy summary CSV")
    parser.add_argument("--md", required=True, help="output markdown summary")
    parser.add_argument("--trust", help="output JSON: the trust panel, machine-readable")
    parser.add_argument("--plot", required=True, help="output PNG: tau by drafter and dataset")
    parser.add_argument("--plot-dir", help="where the other plots go (" + ", ".join(
        plots.NAMES[k] for k in ("step", "position", "histogram")) + "); default: the --plot directory")


def ordered_settings(settings: dict) -> dict:
    """Drafters in config order: the settings JSON sorts keys, `drafter_order` keeps the user's order."""
    drafters = settings.get("drafters") or {}
    listed = [n for n in settings.get("drafter_order") or [] if n in drafters]
    return {**settings, "drafters": {name: drafters[name] for name in listed + [n for n in drafters if n not in listed]}}


def run(args: argparse.Namespace) -> int:
    settings = ordered_settings(settings_from_args(args, report_settings))
    check_settings(settings)
    evaluations = collect(settings, args.metrics)
    rows = summary_rows(evaluations, settings)
    panel = trust_panel(evaluations, settings, args.hidden, args.completions,
                        args.transitions or settings.get("transitions"))
    atomic_write_text(args.csv, summary_frame(rows).to_csv(index=False))
    atomic_write_text(args.md, render_markdown(rows, evaluations, settings, panel))
    written = [args.csv, args.md]
    if args.trust:
        atomic_write_json(args.trust, panel)
        written.append(args.trust)
    chains = {e.key: e.metrics["chain"] for e in evaluations}
    written += plots.write_all(rows, chains, settings, args.plot, args.plot_dir or Path(args.plot).parent)
    for warning in warnings(evaluations) + panel["warnings"]:
        log.warning("%s", _plain(warning))
    log.info("report of %d evaluations written: %s", len(evaluations), ", ".join(map(str, written)))
    return 0


# -- reading and checking ------------------------------------------------------------------------

REQUIRED = ("drafter", "dataset", "block_size", "layer_ids", "checkpoint", "cache.backend",
            "cache.backend_mismatch_allowed", "chain.tau_mean_of_samples", "chain.tau_token_weighted",
            "chain.samples", "chain.steps", "chain.tokens", "chain.ci95", "diagnostics")


def check_settings(settings: dict) -> None:
    """The settings must name something to report, and a reference that is one of the drafters."""
    if not settings.get("drafters") or not settings.get("datasets"):
        raise DflashEvalError("report settings name no drafters or no datasets: nothing to report")
    reference = settings.get("reference")
    if reference is not None and reference not in settings["drafters"]:
        raise DflashEvalError(f"report reference {reference!r} is not one of the drafters: {', '.join(settings['drafters'])}")
    served = settings.get("served_drafter")
    if served is not None and served not in settings["drafters"]:
        raise DflashEvalError(f"report served_drafter {served!r} is not one of the drafters: {', '.join(settings['drafters'])}")


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
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DflashEvalError(f"{path}: not valid JSON ({error})") from error
    for field in REQUIRED:
        try:
            _lookup(metrics, field)
        except KeyError:
            raise DflashEvalError(f"{path}: no {field!r}; is it a metrics.json written by `dflash-eval evaluate`?") from None
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
            raise DflashEvalError(f"{found[evaluation.key].path} and {path} both hold drafter "
                                  f"{evaluation.key[0]!r} on dataset {evaluation.key[1]!r}; pass one")
        found[evaluation.key] = evaluation
    ordered = [_expected(found, drafter, dataset) for drafter in settings["drafters"] for dataset in settings["datasets"]]
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
        raise DflashEvalError(f"{evaluation.path}: evaluated with layer ids {actual} but the config says "
                              f"{list(expected)} for drafter {evaluation.key[0]!r}; re-run its evaluation")


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


def method_rows(evaluation: Evaluation, spec: dict) -> list[dict]:
    """One row per method of one evaluation: each chain block size and each DDTree budget."""
    metrics = evaluation.metrics
    cache = metrics["cache"]
    methods = metrics.get("methods") or {f"chain-B{metrics['block_size']}": metrics["chain"]}
    agreement = metrics["diagnostics"].get("argmax_agreement")
    rows = []
    for method, stats in sorted(methods.items(), key=lambda item: method_order(item[0])):
        ci, ci_tw = _pair(stats["ci95"].get("tau_mean_of_samples")), _pair(stats["ci95"].get("tau_token_weighted"))
        rows.append({
            "drafter": metrics["drafter"], "dataset": metrics["dataset"], "method": method,
            "primary": method == f"chain-B{metrics['block_size']}",
            "block_size": int(stats.get("block_size", metrics["block_size"])), "budget": stats.get("budget"),
            "tau_mean_of_samples": _float(stats["tau_mean_of_samples"]),
            "tau_token_weighted": _float(stats["tau_token_weighted"]),
            "ci_low": ci[0], "ci_high": ci[1], "ci_low_tw": ci_tw[0], "ci_high_tw": ci_tw[1],
            "samples": int(stats["samples"]), "steps": int(stats["steps"]), "tokens": int(stats["tokens"]),
            "training_step": training_step(metrics, spec),
            "layer_ids": " ".join(str(i) for i in metrics["layer_ids"]),
            "backend": cache["backend"], "backend_mismatch_allowed": bool(cache["backend_mismatch_allowed"]),
            "argmax_agreement": _float(agreement), "tau_vs_reference": math.nan,
            "diff_vs_reference": math.nan, "diff_ci_low": math.nan, "diff_ci_high": math.nan, "verdict": "",
        })
    return rows


def method_order(method: str) -> tuple[int, int, str]:
    """Chains by block size, then DDTree by budget: metrics.json sorts keys as text (ddtree-16 < ddtree-8)."""
    kind, _, size = method.partition("-")
    number = size.lstrip("B")
    return (0 if kind == "chain" else 1, int(number) if number.isdigit() else 0, method)


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def per_sample_steps(evaluation: Evaluation) -> dict[str, dict[str, list[int]]]:
    """method -> sample id -> acceptance lengths, from the samples.csv written beside metrics.json."""
    path = evaluation.path.with_name("samples.csv")
    if not path.is_file():
        raise DflashEvalError(f"{path} not found; the paired comparison needs the evaluate stage's per-sample rows")
    frame = pd.read_csv(path, dtype={"id": str, "acceptance_lengths": str}, keep_default_na=False)
    if "method" not in frame:
        frame["method"] = f"chain-B{evaluation.metrics['block_size']}"
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
    for row in rows:
        if row["drafter"] == reference:
            continue
        mine = steps.get((row["drafter"], row["dataset"]), {})
        theirs = steps.get((reference, row["dataset"]), {})
        method = row["method"] if row["method"] in theirs else None
        if row["primary"]:  # own-block chains compare across block sizes, as in tau_vs_reference
            method = next((r["method"] for r in rows if r["drafter"] == reference and r["dataset"] == row["dataset"]
                           and r["primary"]), None)
        if method is None or row["method"] not in mine:
            continue
        paired = acceptance.paired_difference(mine[row["method"]], theirs[method], settings.get("bootstrap", 1000),
                                              settings.get("seed", 0))["tau_mean_of_samples"]
        row.update(diff_vs_reference=paired["difference"], diff_ci_low=paired["ci95"][0],
                   diff_ci_high=paired["ci95"][1], verdict=acceptance.verdict(paired["ci95"]))


def summary_rows(evaluations: list[Evaluation], settings: dict) -> list[dict]:
    """All rows in config order, with tau relative to the reference drafter when there is one."""
    rows = [row for e in evaluations for row in method_rows(e, settings["drafters"][e.key[0]])]
    add_verdicts(rows, evaluations, settings)
    reference = settings.get("reference")
    if reference is not None:
        baseline = {(r["dataset"], _comparable(r)): r["tau_mean_of_samples"]
                    for r in rows if r["drafter"] == reference}
        for row in rows:
            base = baseline.get((row["dataset"], _comparable(row)), math.nan)
            row["tau_vs_reference"] = row["tau_mean_of_samples"] / base if base and not math.isnan(base) else math.nan
    return rows


def trust_panel(evaluations: list[Evaluation], settings: dict, hidden: Iterable[str | Path],
                completions: Iterable[str | Path], transitions: str | Path | None) -> dict:
    """Everything the "can I trust this" panel shows, as data (trust.json holds the same)."""
    fetched = {}
    for path in map(Path, completions):
        if path.is_file():
            fetched[path.name.removesuffix(".jsonl")] = trust.read_completions(path)
        else:
            log.warning("%s not found: its fetch checks are reported as not recorded", path)
    cache_dataset = {os.path.abspath(e.metrics["cache"]["dir"]): e.key[1] for e in evaluations}
    directories: dict[str, str] = {}   # absolute path -> as first named (relative paths stay relative)
    for directory in [str(h) for h in hidden] + [str(e.metrics["cache"]["dir"]) for e in evaluations]:
        directories.setdefault(os.path.abspath(directory), os.path.normpath(directory))
    caches = []
    for key, directory in directories.items():
        dataset = cache_dataset.get(key, Path(directory).parent.name)
        caches.append(trust.cache_entry(directory, fetched[dataset].sha256 if dataset in fetched else None))
    served = settings.get("served_drafter")
    by_key = {e.key: e for e in evaluations}
    online = {}
    for dataset in settings["datasets"]:
        steps, own_block = None, None
        if served is not None:
            evaluation = by_key[(served, dataset)]
            steps, own_block = per_sample_steps(evaluation), evaluation.metrics["block_size"]
        entry = trust.online_vs_offline(fetched.get(dataset), steps, float(settings.get("online_tolerance", 0.05)),
                                        own_block)
        online[dataset] = {**entry, "drafter": served}
    panel = {
        "caches": caches,
        "fetch": {dataset: trust.fetch_entry(fetched.get(dataset)) for dataset in settings["datasets"]},
        "evaluations": [evaluation_entry(e) for e in evaluations],
        "online": online,
        "server": trust.server_outages(transitions),
    }
    panel["warnings"] = trust.warnings(panel)
    return panel


def evaluation_entry(evaluation: Evaluation) -> dict:
    """What one evaluation says about itself: backend, argmax agreement with the completions, skips."""
    metrics = evaluation.metrics
    cache, diagnostics = metrics["cache"], metrics["diagnostics"]
    return {"drafter": metrics["drafter"], "dataset": metrics["dataset"], "cache_dir": cache["dir"],
            "backend": cache["backend"], "trained_with": cache.get("trained_with"),
            "backend_mismatch_allowed": bool(cache["backend_mismatch_allowed"]),
            "argmax_agreement": diagnostics.get("argmax_agreement"), "tokens_seen": diagnostics.get("tokens_seen"),
            "samples": int(metrics["chain"]["samples"]), "samples_skipped": list(diagnostics.get("samples_skipped") or [])}


def summary_frame(rows: list[dict]) -> pd.DataFrame:
    """The CSV's table; the nullable integer step keeps "1000" from becoming "1000.0"."""
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["training_step"] = frame["training_step"].astype("Int64")
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def _comparable(row: dict) -> str:
    """Own-block chains compare across block sizes (the drafter's block is part of what is compared)."""
    return "chain" if row["primary"] else row["method"]


# -- markdown ------------------------------------------------------------------------------------

def _missing(value: Any) -> bool:
    return value is None or bool(pd.isna(value))


def _fmt(value: Any, digits: int = DIGITS) -> str:
    return "n/a" if _missing(value) else f"{value:.{digits}f}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def headline(row: dict) -> bool:
    """The main table's methods: each drafter's own chain and every DDTree budget (shorter chains go below)."""
    return row["primary"] or not row["method"].startswith("chain-")


def _columns(rows: list[dict], settings: dict, keep: Any = headline) -> list[tuple[str, str]]:
    """(dataset, method) pairs: datasets in config order, methods in order of first appearance."""
    columns: list[tuple[str, str]] = []
    for dataset in settings["datasets"]:
        for row in rows:
            if row["dataset"] == dataset and keep(row) and (dataset, row["method"]) not in columns:
                columns.append((dataset, row["method"]))
    return columns


def _best(rows: list[dict], column: tuple[str, str], value: str) -> float | None:
    """Best value at the shown precision, so that equal-looking numbers are bold together."""
    shown = [round(r[value], DIGITS) for r in rows if (r["dataset"], r["method"]) == column and not _missing(r[value])]
    return max(shown) if shown else None


def _tau_cell(row: dict | None, value: str, low: str, high: str, best: float | None) -> str:
    if row is None:
        return "–"
    text = _fmt(row[value])
    if best is not None and not _missing(row[value]) and round(row[value], DIGITS) == best:
        text = f"**{text}**"
    if not _missing(row[low]):
        text += f" <sub>[{_fmt(row[low])}, {_fmt(row[high])}]</sub>"
    return text + (" ⚠️" if row["backend_mismatch_allowed"] else "")


def _steps_by_drafter(rows: list[dict]) -> dict[str, Any]:
    return {r["drafter"]: r["training_step"] for r in rows if not _missing(r["training_step"])}


def tau_table(rows: list[dict], settings: dict, value: str, low: str, high: str, keep: Any = headline) -> list[str]:
    """Drafters as rows, dataset x method as columns, tau with its CI, best per column in bold."""
    columns = _columns(rows, settings, keep)
    steps = _steps_by_drafter(rows)
    by_key = {(r["drafter"], r["dataset"], r["method"]): r for r in rows}
    best = {column: _best(rows, column, value) for column in columns}
    lead = ["drafter", "training step"] if steps else ["drafter"]
    lines = [_table_row(lead + [f"{d}<br>{m}" for d, m in columns]),
             _table_row(["---"] * len(lead) + ["---:"] * len(columns))]
    for drafter in settings["drafters"]:
        cells = [_drafter_label(drafter, settings)] + ([steps.get(drafter, "")] if steps else [])
        cells += [_tau_cell(by_key.get((drafter, *column)), value, low, high, best[column]) for column in columns]
        lines.append(_table_row(cells))
    return lines


def reference_table(rows: list[dict], settings: dict) -> list[str]:
    """tau (z-lab mean) of each drafter as a percentage of the reference drafter's (main-table methods)."""
    columns = _columns(rows, settings)
    by_key = {(r["drafter"], r["dataset"], r["method"]): r for r in rows}
    lines = [_table_row(["drafter"] + [f"{d}<br>{m}" for d, m in columns]), _table_row(["---"] + ["---:"] * len(columns))]
    for drafter in settings["drafters"]:
        cells = [_drafter_label(drafter, settings)]
        for column in columns:
            row = by_key.get((drafter, *column))
            ratio = None if row is None else row["tau_vs_reference"]
            cells.append("–" if _missing(ratio) else f"{100 * ratio:.1f}%")
        lines.append(_table_row(cells))
    return lines


def verdict_table(rows: list[dict], settings: dict) -> list[str]:
    """One line per drafter x dataset x method compared with the reference."""
    lines = [_table_row(["drafter", "dataset", "method", "difference", "95% CI", "verdict"]),
             _table_row(["---", "---", "---", "---:", "---", "---"])]
    for row in rows:
        if not row["verdict"]:
            continue
        verdict = f"**{row['verdict']}**" if row["verdict"] in ("better", "worse") else row["verdict"]
        lines.append(_table_row([row["drafter"], row["dataset"], row["method"], f"{row['diff_vs_reference']:+.{DIGITS}f}",
                                 f"[{_fmt(row['diff_ci_low'])}, {_fmt(row['diff_ci_high'])}]", verdict]))
    return lines


def warnings(evaluations: list[Evaluation]) -> list[str]:
    """Everything that makes a number suspect, one markdown line each."""
    found = []
    for evaluation in evaluations:
        metrics, (drafter, dataset) = evaluation.metrics, evaluation.key
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        if cache["backend_mismatch_allowed"]:
            found.append(f"**Backend mismatch**: {drafter} on {dataset} was evaluated on hidden states from the "
                         f"`{cache['backend']}` kernels but trained with `{cache.get('trained_with', '?')}` ones "
                         "(allowed by evaluation.allow_backend_mismatch); its tau is not the deployed one.")
        agreement = diagnostics.get("argmax_agreement")
        if agreement is not None and agreement < LOW_AGREEMENT:
            found.append(f"**Low argmax agreement**: {drafter} on {dataset}: {agreement:.1%} of completion tokens "
                         "are the cached target's own greedy choice; the cache may not come from the served model.")
        if diagnostics.get("samples_skipped"):
            found.append(f"**Skipped samples**: {drafter} on {dataset}: {len(diagnostics['samples_skipped'])} "
                         "sample(s) not evaluated (see Diagnostics).")
        if int(metrics["chain"]["samples"]) == 0:
            found.append(f"**No samples**: {drafter} on {dataset} evaluated no sample; its tau is undefined.")
    return found


def _plain(markdown: str) -> str:
    return markdown.replace("**", "").replace("`", "")


def _skipped_summary(skipped: list[dict]) -> str:
    if not skipped:
        return "0"
    listed = ", ".join(f"{s.get('id')} ({s.get('why', '?')})" for s in skipped[:MAX_LISTED_SKIPS])
    more = f", … {len(skipped) - MAX_LISTED_SKIPS} more" if len(skipped) > MAX_LISTED_SKIPS else ""
    return f"**{len(skipped)}**: {listed}{more}"


def _checkpoint_summary(checkpoint: dict) -> str:
    name = Path(str(checkpoint.get("path", "?"))).name
    digest = checkpoint.get("sha256")
    return f"{name} (sha256 {digest[:12]})" if digest else name


def diagnostics_table(evaluations: list[Evaluation], fetch: dict[str, dict]) -> list[str]:
    """Per evaluation: kernel backend, mismatch (loud), fetch token checks, argmax agreement, skips, checkpoint."""
    header = ["drafter", "dataset", "cache backend", "trained with", "backend mismatch", "token mismatches at fetch",
              "completion ids from", "argmax agreement", "samples", "skipped", "layer ids", "checkpoint"]
    lines = [_table_row(header), _table_row(["---"] * len(header))]
    for evaluation in evaluations:
        metrics = evaluation.metrics
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        agreement = diagnostics.get("argmax_agreement")
        agreement_text = "n/a (no argmax stored)" if agreement is None else f"{agreement:.2%}"
        if agreement is not None and agreement < LOW_AGREEMENT:
            agreement_text = f"**{agreement_text} ⚠️ LOW**"
        mismatch = "**⚠️ YES (allowed)**" if cache["backend_mismatch_allowed"] else "no"
        lines.append(_table_row([
            metrics["drafter"], metrics["dataset"], cache["backend"], cache.get("trained_with", "?"), mismatch,
            *trust.fetch_cells(fetch.get(metrics["dataset"]) or {}),
            agreement_text, metrics["chain"]["samples"], _skipped_summary(diagnostics.get("samples_skipped") or []),
            ", ".join(str(i) for i in metrics["layer_ids"]), _checkpoint_summary(metrics.get("checkpoint") or {}),
        ]))
    return lines


INTRO = (
    "tau (acceptance length) = accepted draft tokens + 1 (the bonus token) per verification step, with greedy "
    "verification against the target's own greedy completions. **z-lab mean**: mean over samples of each "
    "sample's mean tau. **Token-weighted**: total tokens / total verification steps (the SGLang convention). "
    "<sub>[a, b]</sub>: 95% bootstrap confidence interval over samples. **Bold**: best in its column "
    f"(at the {DIGITS} decimals shown). `chain-B<n>`: chain drafting with block size n (the drafter's own B "
    "here); `ddtree-<N>`: DDTree with N nodes besides the root. ⚠️: see Warnings."
)


def render_markdown(rows: list[dict], evaluations: list[Evaluation], settings: dict, panel: dict) -> str:
    """The whole summary.md: warnings first (loud), the main table, verdicts, then diagnostics and trust."""
    lines = ["# DFlash drafter evaluation", "", INTRO, ""]
    found = warnings(evaluations) + panel["warnings"]
    if found:
        lines += ["## ⚠️ Warnings", ""] + [f"- {w}" for w in found] + [""]
    lines += ["## tau, z-lab mean (mean of per-sample means)", ""]
    lines += tau_table(rows, settings, "tau_mean_of_samples", "ci_low", "ci_high") + [""]
    if settings.get("reference") is not None:
        lines += [f"## Verdicts against the reference ({settings['reference']})", "",
                  "Paired difference in tau (z-lab mean) on the same samples, with its 95% paired bootstrap "
                  "interval: **better** or **worse** when the whole interval is above or below zero.", ""]
        lines += verdict_table(rows, settings) + [""]
        lines += [f"## tau relative to the reference ({settings['reference']}), z-lab mean", ""]
        lines += reference_table(rows, settings) + [""]
    lines += ["## tau, token-weighted (tokens / steps)", ""]
    lines += tau_table(rows, settings, "tau_token_weighted", "ci_low_tw", "ci_high_tw") + [""]
    shorter = [r for r in rows if not headline(r)]
    if shorter:
        lines += ["## Chain drafting with shorter blocks, z-lab mean", "",
                  "The same drafter run with blocks of n < B tokens (each its own pass; full-attention drafter "
                  "layers see the whole block, so a shorter block drafts differently).", ""]
        lines += tau_table(rows, settings, "tau_mean_of_samples", "ci_low", "ci_high",
                           keep=lambda r: not headline(r)) + [""]
    lines += ["## Diagnostics: can I trust these numbers?", "",
              "### Per evaluation", "",
              "Argmax agreement: share of completion tokens that equal the cached target's own greedy "
              "prediction; well below 100% means the cached target is not the model that served the "
              "completions. A backend mismatch means the hidden states came from other kernels than the "
              "drafter was trained with. Token mismatches at fetch: records whose token ids disagree with the "
              "server's own prompt / completion token counts.", ""]
    lines += diagnostics_table(evaluations, panel["fetch"]) + [""]
    lines += ["### Hidden-state caches", ""] + trust.cache_table(panel["caches"]) + [""]
    tolerance = float(settings.get("online_tolerance", 0.05))
    lines += ["### Online vs offline", "",
              "The server's own speculative counters (SGLang's `sglext.spec_tokens_details`) per request, beside "
              "the served drafter's offline steps at the served block size on the same samples. "
              + online_check.DEFINITIONS
              + f" Flagged when the two tau differ by more than {tolerance:.1%} (report.online_tolerance).", ""]
    lines += trust.online_table(panel["online"]) + [""]
    lines += ["### Server outages", ""] + trust.outage_lines(panel["server"]) + [""]
    return "\n".join(lines)
