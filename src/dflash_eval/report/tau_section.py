"""summary.md's tau tables: drafters as rows, dataset x method as columns, each value with its interval, the best
per column in bold; the verdicts and the percentages against the reference; tau against temperature; the rejection
scheme's table; the sampling labels they share (docs/report.md)."""

from __future__ import annotations

from typing import Any

from dflash_eval.methods import REJECTION, TARGET_ONLY, TREE, in_main_table, parse
from dflash_eval.report.labels import DIGITS, drafter_label, fmt, missing, samples
from dflash_eval.report.md_table import table_row


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


def method_grid(rows: list[dict], settings: dict, value: str, cell: Any, keep: Any = headline) -> list[str]:
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
    return method_grid(rows, settings, value, lambda row, best: _tau_cell(row, value, low, high, best), keep)


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
    rejection = [r for r in rows if r["scheme"] == REJECTION]
    if not rejection:
        return []
    served = {(r["drafter"], r["dataset"], r["method"]): r for r in rows if r["scheme"] == TARGET_ONLY}
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
