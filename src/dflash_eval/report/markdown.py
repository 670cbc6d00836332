"""summary.md, for people: warnings first, tau with its confidence interval and the best per column in
bold, the verdicts against the reference, then the Diagnostics ("can I trust these numbers?").

Every markdown line of the report is made here, from the rows (report/summary.py) and the trust
panel's data (report/trust.py); a suspect number (kernel backend mismatch, low argmax agreement,
skipped samples, a stale cache) is made impossible to miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash_eval.methods import (
    TREE,
    in_main_table,
    legend,
    parse,
    tree_method,
    verified_legend,
)
from dflash_eval.report import engine_timing
from dflash_eval.report import online as online_check
from dflash_eval.report.labels import DIGITS, HYPOTHETICAL_TREE, drafter_label, fmt, missing, samples
from dflash_eval.report.summary import Evaluation, dataset_sampling
from dflash_eval.report.trust import NOT_RECORDED
from dflash_eval.speedup import labels as speedup
from dflash_eval.speedup import validation

LOW_AGREEMENT = 0.95  # below this the cached target is likely not the one that served
MAX_LISTED_SKIPS = 5


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def headline(row: dict) -> bool:
    """The main table's methods: each drafter's own chain and every DDTree budget (shorter chains go below)."""
    return in_main_table(row["method"], row["primary"])


def _columns(rows: list[dict], settings: dict, keep: Any = headline) -> list[tuple[str, str]]:
    """(dataset, method) pairs: datasets in config order, methods in order of first appearance."""
    columns: list[tuple[str, str]] = []
    for dataset in settings["datasets"]:
        for row in rows:
            if row["dataset"] == dataset and keep(row) and (dataset, row["method"]) not in columns:
                columns.append((dataset, row["method"]))
    return columns


def _sampled_rows(rows: list[dict], dataset: str) -> list[dict]:
    return [r for r in rows if r["dataset"] == dataset and samples(r)]


def _column_label(rows: list[dict], dataset: str, method: str) -> str:
    """A main-table column: the dataset with its sampling when it samples (target_only, SGLang's scheme, on the
    served completions), and a DDTree method at T > 0 marked hypothetical (HYPOTHETICAL_TREE)."""
    sampled = _sampled_rows(rows, dataset)
    if not sampled:
        return f"{dataset}<br>{method}"
    drawn = drawn_label({key: sampled[0][key] for key in ("temperature", "top_p", "top_k", "min_p")})
    tree = " †" if is_tree(method) else ""
    return f"{dataset} ({drawn}, target_only)<br>{method}{tree}"


def is_tree(method: str) -> bool:
    return parse(method).kind.name == TREE.name


def _best(rows: list[dict], column: tuple[str, str], value: str) -> float | None:
    """Best value at the shown precision, so that equal-looking numbers are bold together."""
    shown = [round(r[value], DIGITS) for r in rows if (r["dataset"], r["method"]) == column and not missing(r[value])]
    return max(shown) if shown else None


def _tau_cell(row: dict | None, value: str, low: str, high: str, best: float | None) -> str:
    if row is None:
        return "–"
    text = fmt(row[value])
    if best is not None and not missing(row[value]) and round(row[value], DIGITS) == best:
        text = f"**{text}**"
    if not missing(row[low]):
        text += f" <sub>[{fmt(row[low])}, {fmt(row[high])}]</sub>"
    return text + (" ⚠️" if row["backend_mismatch_allowed"] else "")


def _steps_by_drafter(rows: list[dict]) -> dict[str, Any]:
    return {r["drafter"]: r["training_step"] for r in rows if not missing(r["training_step"])}


def _method_grid(rows: list[dict], settings: dict, value: str, cell: Any, keep: Any = headline) -> list[str]:
    """Drafters as rows (with the training step when known), dataset x method as columns; `cell(row, best)`
    shows one row's `value`, `best` being its column's best at the shown precision."""
    columns = _columns(rows, settings, keep)
    steps = _steps_by_drafter(rows)
    by_key = {(r["drafter"], r["dataset"], r["method"]): r for r in rows}
    best = {column: _best(rows, column, value) for column in columns}
    lead = ["drafter", "training step"] if steps else ["drafter"]
    lines = [
        table_row(lead + [_column_label(rows, d, m) for d, m in columns]),
        table_row(["---"] * len(lead) + ["---:"] * len(columns)),
    ]
    for drafter in settings["drafters"]:
        cells = [drafter_label(drafter, settings)] + ([steps.get(drafter, "")] if steps else [])
        cells += [cell(by_key.get((drafter, *column)), best[column]) for column in columns]
        lines.append(table_row(cells))
    return lines


def tau_table(rows: list[dict], settings: dict, value: str, low: str, high: str, keep: Any = headline) -> list[str]:
    """Drafters as rows, dataset x method as columns, tau with its CI, best per column in bold."""
    return _method_grid(rows, settings, value, lambda row, best: _tau_cell(row, value, low, high, best), keep)


def reference_table(rows: list[dict], settings: dict) -> list[str]:
    """tau (z-lab mean) of each drafter as a percentage of the reference drafter's (main-table methods)."""
    columns = _columns(rows, settings)
    by_key = {(r["drafter"], r["dataset"], r["method"]): r for r in rows}
    lines = [
        table_row(["drafter"] + [_column_label(rows, d, m) for d, m in columns]),
        table_row(["---"] + ["---:"] * len(columns)),
    ]
    for drafter in settings["drafters"]:
        cells = [drafter_label(drafter, settings)]
        for column in columns:
            row = by_key.get((drafter, *column))
            ratio = None if row is None else row["tau_vs_reference"]
            cells.append("–" if missing(ratio) else f"{100 * ratio:.1f}%")
        lines.append(table_row(cells))
    return lines


def verdict_table(rows: list[dict], settings: dict) -> list[str]:
    """One line per drafter x dataset x method compared with the reference."""
    lines = [
        table_row(["drafter", "dataset", "method", "difference", "95% CI", "verdict"]),
        table_row(["---", "---", "---", "---:", "---", "---"]),
    ]
    for row in rows:
        if not row["verdict"]:
            continue
        verdict = f"**{row['verdict']}**" if row["verdict"] in ("better", "worse") else row["verdict"]
        lines.append(
            table_row(
                [
                    row["drafter"],
                    row["dataset"],
                    row["method"],
                    f"{row['diff_vs_reference']:+.{DIGITS}f}",
                    f"[{fmt(row['diff_ci_low'])}, {fmt(row['diff_ci_high'])}]",
                    verdict,
                ]
            )
        )
    return lines


def rejection_table(rows: list[dict], settings: dict) -> list[str]:
    """dflash_generate's scheme beside SGLang's: expected tau given each sampled completion, with its interval and
    the samples it covers, next to the target_only tau and samples of the same drafter, dataset and block, and the
    share of samples holding a token outside dflash's support (scored at its anchor, not dropped); empty when none
    was asked for."""
    rejection = [r for r in rows if r["scheme"] == "rejection"]
    if not rejection:
        return []
    served = {(r["drafter"], r["dataset"], r["method"]): r for r in rows if r["scheme"] == "target_only"}
    lines = [
        "## Under dflash_generate's speculative sampling (verify: rejection)",
        "",
        "Expected tau given each sampled completion (docs/sampling_rejection.md), beside SGLang's target-only "
        "verification on the same completions; each with the samples it covers. Outside support: samples "
        "with a verified token that dflash's top-k/top-p filter excludes (flashinfer's tie rule, or a bf16 "
        "server's logits near the cut), scored as a rejection at its anchor.",
        "",
        table_row(
            [
                "drafter",
                "dataset",
                "method",
                "sampling",
                "tau target_only",
                "samples",
                "tau rejection (expected)",
                "95% CI",
                "samples",
                "outside support",
            ]
        ),
        table_row(["---"] * 4 + ["---:"] * 6),
    ]
    for row in rejection:
        other = served.get((row["drafter"], row["dataset"], row["method"]))
        drawn = drawn_label({key: row[key] for key in ("temperature", "top_p", "top_k", "min_p")})
        outside = row.get("outside_support_samples")
        share = "–" if outside is None else f"{outside} ({row['outside_support_share']:.1%})"
        lines.append(
            table_row(
                [
                    drafter_label(row["drafter"], settings),
                    row["dataset"],
                    row["method"],
                    drawn,
                    fmt(other["tau_mean_of_samples"]) if other else "-",
                    other["samples"] if other else "-",
                    fmt(row["tau_mean_of_samples"]),
                    f"{fmt(row['ci_low'])}..{fmt(row['ci_high'])}",
                    row["samples"],
                    share,
                ]
            )
        )
    return [*lines, ""]


def sampled_at(metrics: dict) -> float:
    """The temperature the evaluated completions were sampled at (0: greedy; NaN: several)."""
    return float(dataset_sampling(metrics).get("temperature", 0.0))


def agreement_is_low(metrics: dict) -> bool:
    """The cached target's argmax should reproduce a greedy completion; a sampled one (T > 0) leaves its argmax
    by design, so there the agreement checks nothing and is never flagged."""
    agreement = metrics["diagnostics"].get("argmax_agreement")
    return agreement is not None and agreement < LOW_AGREEMENT and sampled_at(metrics) == 0


def evaluation_warnings(evaluations: list[Evaluation]) -> list[str]:
    """Everything that makes a number suspect, one markdown line each."""
    found = []
    for evaluation in evaluations:
        metrics, (drafter, dataset) = evaluation.metrics, evaluation.key
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        if cache["backend_mismatch_allowed"]:
            found.append(
                f"**Backend mismatch**: {drafter} on {dataset} was evaluated on hidden states from the "
                f"`{cache['backend']}` kernels but trained with `{cache.get('trained_with', '?')}` ones "
                "(allowed by evaluation.allow_backend_mismatch); its tau is not the deployed one."
            )
        agreement = diagnostics.get("argmax_agreement")
        if agreement_is_low(metrics):
            found.append(
                f"**Low argmax agreement**: {drafter} on {dataset}: {agreement:.1%} of completion tokens "
                "are the cached target's own greedy choice; the cache may not come from the served model."
            )
        outside = (metrics.get("rejection") or {}).get("outside_support") or {}
        if outside.get("samples"):
            found.append(
                f"**Tokens outside dflash's support**: {drafter} on {dataset}: {outside['samples']} of "
                f"{outside['samples_scored']} samples ({outside['share_of_samples']:.1%}; {outside['tokens']} "
                "tokens) hold a verified token dflash's top-k/top-p filter excludes, scored as a rejection at "
                "its anchor: their expected tau under `rejection` is a lower bound."
            )
        for why in (diagnostics.get("sampled_check") or {}).get("suspect", []):
            found.append(
                f"**Sampled cache check**: {drafter} on {dataset}: {why}; the cache may not come from the served model."
            )
        if diagnostics.get("samples_skipped"):
            found.append(
                f"**Skipped samples**: {drafter} on {dataset}: {len(diagnostics['samples_skipped'])} "
                "sample(s) not evaluated (see Diagnostics)."
            )
        if int(metrics["chain"]["samples"]) == 0:
            found.append(f"**No samples**: {drafter} on {dataset} evaluated no sample; its tau is undefined.")
    return found


def plain(markdown: str) -> str:
    """A markdown line for the log."""
    return markdown.replace("**", "").replace("`", "")


def _skipped_summary(skipped: list[dict]) -> str:
    if not skipped:
        return "0"
    listed = ", ".join(f"{s.get('id')} ({s.get('why', '?')})" for s in skipped[:MAX_LISTED_SKIPS])
    more = f", … {len(skipped) - MAX_LISTED_SKIPS} more" if len(skipped) > MAX_LISTED_SKIPS else ""
    return f"**{len(skipped)}**: {listed}{more}"


def _sampled_check_text(diagnostics: dict) -> str:
    """The T > 0 cache check beside the argmax agreement (evaluate/sampled_check.py)."""
    check = diagnostics.get("sampled_check") or {}
    parts = []
    if check.get("argmax_floor") is not None:
        parts.append(f"floor {check['argmax_floor']:.1%}")
    if check.get("support_share") is not None:
        parts.append(f"{check['support_share']:.2%} of tokens in the top-k/top-p support")
    text = "; ".join(parts) or "not a check without top_k or target log-probs"
    return f"**{text} ⚠️ SUSPECT**" if check.get("suspect") else text


def _checkpoint_summary(checkpoint: dict) -> str:
    name = Path(str(checkpoint.get("path", "?"))).name
    digest = checkpoint.get("sha256")
    return f"{name} (sha256 {digest[:12]})" if digest else name


def diagnostics_table(evaluations: list[Evaluation], fetch: dict[str, dict]) -> list[str]:
    """Per evaluation: kernel backend, mismatch (loud), fetch token checks, argmax agreement, skips, checkpoint."""
    header = [
        "drafter",
        "dataset",
        "cache backend",
        "trained with",
        "backend mismatch",
        "token mismatches at fetch",
        "completion ids from",
        "argmax agreement",
        "samples",
        "skipped",
        "layer ids",
        "checkpoint",
    ]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for evaluation in evaluations:
        metrics = evaluation.metrics
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        agreement = diagnostics.get("argmax_agreement")
        agreement_text = "n/a (no argmax stored)" if agreement is None else f"{agreement:.2%}"
        if agreement_is_low(metrics):
            agreement_text = f"**{agreement_text} ⚠️ LOW**"
        elif agreement is not None and sampled_at(metrics) != 0:
            agreement_text += f" (sampled at T {sampled_at(metrics):g}: {_sampled_check_text(diagnostics)})"
        mismatch = "**⚠️ YES (allowed)**" if cache["backend_mismatch_allowed"] else "no"
        lines.append(
            table_row(
                [
                    metrics["drafter"],
                    metrics["dataset"],
                    cache["backend"],
                    cache.get("trained_with", "?"),
                    mismatch,
                    *fetch_cells(fetch.get(metrics["dataset"]) or {}),
                    agreement_text,
                    metrics["chain"]["samples"],
                    _skipped_summary(diagnostics.get("samples_skipped") or []),
                    ", ".join(str(i) for i in metrics["layer_ids"]),
                    _checkpoint_summary(metrics.get("checkpoint") or {}),
                ]
            )
        )
    return lines


# -- expected speedup (an estimate) ---------------------------------------------------------------

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
    lines += _method_grid(rows, settings, "expected_speedup", _speedup_cell) + [""]
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


# -- the trust panel ------------------------------------------------------------------------------


def trust_warnings(trust: dict) -> list[str]:
    """The trust findings that make a number suspect, one markdown line each."""
    found = []
    for dataset, fetch in trust["fetch"].items():
        bad = sorted(set(fetch.get("prompt_token_mismatches", [])) | set(fetch.get("completion_token_mismatches", [])))
        if bad:
            found.append(
                f"**Token mismatch at fetch**: {dataset}: {len(bad)} of {fetch['records']} records' token "
                f"ids disagree with the server's own counts (e.g. {', '.join(bad[:3])}); their tau "
                "is measured on tokens the server may not have produced."
            )
    for dataset, fetch in trust["fetch"].items():
        for warning in fetch.get("sampling_warnings", []):
            found.append(f"**Sampling not lossless**: {dataset}: {warning}.")
    for cache in trust["caches"]:
        if cache.get("completions_match") is False:
            found.append(
                f"**Stale cache**: {cache['dir']} was extracted from another completions file "
                f"(sha256 {str(cache['completions_sha256'])[:12]}) than the one fetched now; re-run extraction."
            )
        past = (cache.get("positions") or {}).get("past")
        if past:
            found.append(
                f"**Past the target's positions**: {cache['dir']}: {len(past)} of {cache['samples']} samples "
                f"are longer than its max_position_embeddings {cache['positions']['max_position_embeddings']} "
                f"(e.g. {', '.join(past[:3])}); the target's states there are extrapolated."
            )
    for dataset, online in trust["online"].items():
        check = online.get("served_drafter_check") or {}
        if check.get("status") == "mismatch":
            what = (
                "paired anyway (report.allow_served_drafter_mismatch)"
                if check["allowed"]
                else "not paired (report.allow_served_drafter_mismatch: true pairs them anyway)"
            )
            found.append(
                f"**Served drafter ≠ report.served_drafter**: {dataset}: {'; '.join(check['problems'])}; {what}."
            )
        if online.get("beyond_tolerance"):
            found.append(
                f"**Online ≠ offline**: {dataset}: the server measured tau "
                f"{online['online_tau_compared']:.2f}, offline gives {online['offline_tau_compared']:.2f} for "
                f"{online['drafter']} on the same {online['samples_compared']} samples "
                f"({online['relative_difference']:.1%} apart, tolerance {online['tolerance']:.1%})."
            )
    server = trust["server"]
    if server.get("recorded") and server["unrestored"]:
        found.append(
            f"**Server not restored**: {server['unrestored']} pause(s) in {server['path']} have no "
            "successful resume; check that the server is up."
        )
    return found


def _short(digest: Any, digits: int = 12) -> str:
    return str(digest)[:digits] if digest else NOT_RECORDED


def _versions(versions: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) if versions else NOT_RECORDED


def cache_table(caches: list[dict]) -> list[str]:
    """One row per cache: what produced the hidden states the drafters were scored on."""
    header = [
        "cache",
        "target",
        "layers",
        "kernel backend",
        "versions",
        "dtype",
        "device",
        "shards (sha256)",
        "built from completions",
    ]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for cache in caches:
        if not cache["recorded"]:
            lines.append(table_row([f"`{cache['dir']}`"] + [NOT_RECORDED] * (len(header) - 1)))
            continue
        target = (
            f"{cache['target']} ({cache['model_type']}, {cache['num_hidden_layers']} layers, config "
            f"{_short(cache['target_config_hash'])})"
        )
        device = cache["device"] or NOT_RECORDED
        if cache.get("device_name") and cache["device_name"] != device:
            device += f" ({cache['device_name']})"
        shards = "<br>".join(f"{s['file']} {_short(s['sha256'])}" for s in cache["shards"]) or NOT_RECORDED
        built = {
            None: f"{_short(cache['completions_sha256'])} (current file {NOT_RECORDED})",
            True: f"{_short(cache['completions_sha256'])} (= current file)",
            False: f"**{_short(cache['completions_sha256'])} ⚠️ NOT the current file**",
        }[cache["completions_match"]]
        lines.append(
            table_row(
                [
                    f"`{cache['dir']}`",
                    target,
                    ", ".join(map(str, cache["layer_ids"] or [])) or NOT_RECORDED,
                    f"{cache['backend'] or NOT_RECORDED}",
                    _versions(cache["versions"]),
                    cache["dtype"] or NOT_RECORDED,
                    device,
                    shards,
                    built,
                ]
            )
        )
    return lines


def fetch_cells(fetch: dict) -> list[str]:
    """Token mismatches and id sources of one dataset's fetch, for the per-evaluation table."""
    if not fetch.get("recorded"):
        return [NOT_RECORDED, NOT_RECORDED]
    prompt, completion = len(fetch["prompt_token_mismatches"]), len(fetch["completion_token_mismatches"])
    text = f"prompt {prompt}, completion {completion} of {fetch['records']}"
    if prompt or completion:
        text = f"**{text} ⚠️**"
    if fetch["token_check_absent"]:
        text += f"; {len(fetch['token_check_absent'])} unchecked"
    sources = ", ".join(f"{name} {count}" for name, count in fetch["completion_ids_source"].items())
    return [text, sources]


ONLINE_DEFINITIONS = (
    f"tau: {online_check.TAU_OURS}, mean over requests (z-lab). SGLang's accept length: {online_check.TAU_SGLANG}; "
    "it exceeds tau by 1/steps per request. Equal per request: the server's verification steps and completion "
    "tokens equal ours, and its accepted drafts (spec_num_correct_drafts, histogram) equal ours except for what a "
    "last step accepted past the stop token or max_tokens, which SGLang counts and the output does not hold "
    "(exactly: no such difference)."
)


def online_table(online: dict[str, dict]) -> list[str]:
    """Per dataset: the server's tau beside ours on the same requests, both conventions (report/online.py)."""
    lines = [
        table_row(
            [
                "dataset",
                "served drafter",
                "method",
                "requests",
                "online tau",
                "offline tau",
                "online − offline (95% CI)",
                "SGLang accept length online / offline",
                "equal per request",
                "flag",
            ]
        ),
        table_row(["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"]),
    ]
    for dataset, e in online.items():
        drafter = e.get("drafter") or "not set (report.served_drafter)"
        if not e.get("recorded"):
            why = e.get("why") or "no speculative counters in the completions"
            lines.append(table_row([dataset, drafter, "–", "–", f"{NOT_RECORDED} ({why})", "–", "–", "–", "–", "–"]))
        elif not e.get("compared"):
            lines.append(
                table_row(
                    [
                        dataset,
                        drafter,
                        e.get("method") or "–",
                        e["samples_with_stats"],
                        f"{e['online_tau_mean_of_samples']:.3f}",
                        "–",
                        "–",
                        f"{e['online_tau_sglang_mean_of_samples']:.3f} / –",
                        "–",
                        f"not compared: {e.get('why', '')}",
                    ]
                )
            )
        else:
            diff = e["paired_difference"]
            flag = f"**⚠️ beyond {e['tolerance']:.1%}**" if e["beyond_tolerance"] else f"within {e['tolerance']:.1%}"
            if (e.get("served_drafter_check") or {}).get("status") == "mismatch":
                flag += "; **⚠️ served drafter mismatch**"
            equal = f"{e['equal_requests']} of {e['samples_compared']} ({e['exact_requests']} exactly)"
            if e["unequal_ids"]:
                equal += f"; differ: {', '.join(e['unequal_ids'][:3])}"
            lines.append(
                table_row(
                    [
                        dataset,
                        drafter,
                        e["method"],
                        e["samples_compared"],
                        f"{e['online_tau_compared']:.3f}",
                        f"{e['offline_tau_compared']:.3f}",
                        f"{diff['difference']:+.4f} ({diff['ci95'][0]:+.4f}, {diff['ci95'][1]:+.4f})",
                        f"{e['online_tau_sglang_compared']:.3f} / {e['offline_tau_sglang_compared']:.3f}",
                        equal,
                        flag,
                    ]
                )
            )
    return lines


def outage_lines(server: dict) -> list[str]:
    """Each pause of the server around extraction and how long it lasted."""
    if not server.get("recorded"):
        where = f" ({server['path']} absent)" if server.get("path") else ""
        return [f"Server transitions: {NOT_RECORDED}{where}."]
    if not server["outages"]:
        return [f"No server outage in `{server['path']}` (the server was never paused while up)."]
    longest = "n/a" if server["longest_s"] is None else f"{server['longest_s']:.1f} s"
    profiled = any(outage.get("profiles") for outage in server["outages"])  # profile-server's pauses, apart
    lines = [
        f"{server['count']} outage(s) in `{server['path']}`, {server['total_s']:.1f} s in all, longest {longest}.",
        "",
        table_row(
            ["paused at", "back at", "outage", "restored", "extractions"]
            + (["profile-server runs"] if profiled else [])
        ),
        table_row(["---", "---", "---:", "---", "---:"] + (["---:"] if profiled else [])),
    ]
    for outage in server["outages"]:
        seconds = "**never ended ⚠️**" if outage["seconds"] is None else f"{outage['seconds']:.1f} s"
        lines.append(
            table_row(
                [
                    outage["start"],
                    outage["end"] or "–",
                    seconds,
                    "yes" if outage["restored"] else "**no ⚠️**",
                    outage.get("extractions", 0),
                ]
                + ([outage.get("profiles", 0)] if profiled else [])
            )
        )
    return lines


# -- the page -------------------------------------------------------------------------------------

INTRO = (
    "tau (acceptance length) = accepted draft tokens + 1 (the bonus token) per verification step, with greedy "
    "verification against the target's own greedy completions. **z-lab mean**: mean over samples of each "
    "sample's mean tau. **Token-weighted**: total tokens / total verification steps (the SGLang convention). "
    "<sub>[a, b]</sub>: 95% bootstrap confidence interval over samples. **Bold**: best in its column "
    f"(at the {DIGITS} decimals shown). {legend()}. ⚠️: see Warnings."
)


def drawn_label(d: dict) -> str:
    """One sampling setting, e.g. "T 0.7, top-p 0.95"; "greedy (T 0)" at temperature 0."""
    if missing(d.get("temperature")):
        return "several samplings"
    if not d.get("temperature"):
        return "greedy (T 0)"
    parts = [f"T {d['temperature']:g}"] + [
        f"{name} {d[key]:g}"
        for key, name, off in (("top_p", "top-p", 1.0), ("top_k", "top-k", -1), ("min_p", "min-p", 0.0))
        if d.get(key) is not None and not missing(d[key]) and d[key] != off
    ]
    return ", ".join(parts)


def sampling_label(fetch: dict) -> str:
    """A dataset's sampling as fetched (trust.fetch_entry), e.g. "T 0.7, top-p 0.95"; "greedy" without any."""
    drawn = fetch.get("sampling") or []
    return "; ".join(drawn_label(d) for d in drawn) if drawn else "greedy (T 0)"


def temperature_lines(rows: list[dict], panel: dict) -> list[str]:
    """tau of each drafter's own chain against each dataset's sampling, when any dataset samples: the same drafter
    at the temperatures the datasets were fetched at (target_only, SGLang's scheme: docs/sampling.md)."""
    fetched = panel.get("fetch") or {}
    if not any(f.get("sampling") for f in fetched.values()):
        return []
    lines = [
        "## tau against temperature (target_only verification)",
        "",
        "Each drafter's own chain, z-lab mean with its 95% interval, on each dataset at the sampling it was "
        "fetched with; datasets of the same prompts at several temperatures show how tau falls as the target "
        "samples (docs/sampling.md; plots/tau_vs_temperature.png). With n draws per prompt the intervals "
        "resample prompts, the n draws of one together.",
        "",
        table_row(["drafter", "dataset", "sampling", "samples", "tau (z-lab mean)"]),
        table_row(["---"] * 5),
    ]
    for row in rows:
        if row["primary"]:
            lines.append(
                table_row(
                    [
                        row["drafter"],
                        row["dataset"],
                        sampling_label(fetched.get(row["dataset"], {})),
                        row["samples"],
                        _tau_cell(row, "tau_mean_of_samples", "ci_low", "ci_high", None),
                    ]
                )
            )
    return lines + [""]


SAMPLED_INTRO = (
    "tau (acceptance length) = accepted draft tokens + 1 (the bonus token) per verification step. Every tau above "
    "the rejection section is **target_only** verification, SGLang 0.5.23's DFlash scheme, on the served "
    "completions: on a greedy dataset (T 0) the target's own greedy completions; on a sampled one (its column names "
    "the sampling) the served sampled completions, a greedy draft accepted iff it is the served token. "
)


def intro(rows: list[dict], evaluations: list[Evaluation]) -> str:
    """The page's first paragraph: what each number is under. With a sampled dataset, the scheme of each table,
    the rejection scheme when asked for, and DDTree at T > 0 marked hypothetical."""
    if not any(samples(r) for r in rows):
        return INTRO
    text = SAMPLED_INTRO + INTRO.split("completions. ", 1)[1]
    if any(e.metrics.get("rejection") for e in evaluations):
        text += (
            " The last section is dflash_generate's scheme (verify: rejection): its expected tau given each "
            "sampled completion, with the samples it covers."
        )
    if any(is_tree(r["method"]) and samples(r) for r in rows):
        text += " " + HYPOTHETICAL_TREE
    return text


def render(rows: list[dict], evaluations: list[Evaluation], settings: dict, panel: dict) -> str:
    """The whole summary.md: warnings first (loud), the main table, verdicts, then diagnostics and trust."""
    lines = ["# DFlash drafter evaluation", "", intro(rows, evaluations), ""]
    found = evaluation_warnings(evaluations) + panel["warnings"]
    if found:
        lines += ["## ⚠️ Warnings", ""] + [f"- {w}" for w in found] + [""]
    lines += ["## tau, z-lab mean (mean of per-sample means)", ""]
    lines += tau_table(rows, settings, "tau_mean_of_samples", "ci_low", "ci_high") + [""]
    if settings.get("reference") is not None:
        lines += [
            f"## Verdicts against the reference ({settings['reference']})",
            "",
            "Paired difference in tau (z-lab mean) on the same samples, with its 95% paired bootstrap "
            "interval: **better** or **worse** when the whole interval is above or below zero.",
            "",
        ]
        lines += verdict_table(rows, settings) + [""]
        lines += [f"## tau relative to the reference ({settings['reference']}), z-lab mean", ""]
        lines += reference_table(rows, settings) + [""]
    lines += ["## tau, token-weighted (tokens / steps)", ""]
    lines += tau_table(rows, settings, "tau_token_weighted", "ci_low_tw", "ci_high_tw") + [""]
    lines += temperature_lines(rows, panel)
    lines += speedup_lines(rows, evaluations, settings)
    lines += engine_timing.lines(panel.get("engine_timing") or {})  # the real engine's step time beside it
    lines += engine_timing.profile_lines(panel.get("server_profile"))  # profile-server's, beside the estimate
    shorter = [r for r in rows if not headline(r)]
    if shorter:
        lines += [
            "## Chain drafting with shorter blocks, z-lab mean",
            "",
            "The same drafter run with blocks of n < B tokens (each its own pass; full-attention drafter "
            "layers see the whole block, so a shorter block drafts differently).",
            "",
        ]
        lines += tau_table(
            rows, settings, "tau_mean_of_samples", "ci_low", "ci_high", keep=lambda r: not headline(r)
        ) + [""]
    lines += [
        "## Diagnostics: can I trust these numbers?",
        "",
        "### Per evaluation",
        "",
        "Argmax agreement: share of completion tokens that equal the cached target's own greedy "
        "prediction; well below 100% means the cached target is not the model that served the "
        "completions. A backend mismatch means the hidden states came from other kernels than the "
        "drafter was trained with. Token mismatches at fetch: records whose token ids disagree with the "
        "server's own prompt / completion token counts.",
        "",
    ]
    lines += diagnostics_table(evaluations, panel["fetch"]) + [""]
    lines += ["### Hidden-state caches", ""] + cache_table(panel["caches"]) + [""]
    tolerance = float(settings["online_tolerance"])
    lines += [
        "### Online vs offline",
        "",
        "The server's own speculative counters (SGLang's `sglext.spec_tokens_details`) per request, beside "
        "the served drafter's offline steps at the served block size on the same samples. "
        + ONLINE_DEFINITIONS
        + f" Flagged when the two tau differ by more than {tolerance:.1%} (report.online_tolerance).",
        "",
    ]
    lines += online_table(panel["online"]) + [""]
    lines += ["### Server outages", ""] + outage_lines(panel["server"]) + [""]
    return "\n".join(lines)
