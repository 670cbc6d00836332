"""The report's PNG plots, as a registry: PLOTS maps each plot's name to its file, drawing and caption.

A new plot is one entry in PLOTS (a function that draws a Figure from PlotData) plus its caption,
workflow/report/<caption>.rst: workflow/rules/report.smk declares every entry as an output of the
report rule (captioned in `snakemake --report`), and the report stage draws every entry.

Every plot is drawn on a pyplot-free Figure (no global state; PNG goes through Agg whatever the
backend), 1200 x 600 px, axes labelled with units. A plot with nothing to show (no training steps
known) still renders, saying why, so that the workflow can declare every plot as an output.
This module imports no matplotlib or pandas at load: report.smk imports the registry.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_eval.methods import TARGET_ONLY, TREE, is_kind
from dflash_eval.report.labels import HYPOTHETICAL_TREE, drafter_label, fmt, missing, samples

TAU_LABEL = "acceptance length tau (tokens per verification step)"
FIGSIZE, DPI = (12, 6), 100  # 1200 x 600 px
DEFAULT_RUN = "training run"  # label of the drafters that name no `run:`


@dataclass(frozen=True)
class PlotData:
    """Everything a plot may draw from, the same for every plot."""

    rows: list[dict]  # summary rows (summary.csv), config order
    metrics: dict[tuple[str, str], dict]  # (drafter, dataset) -> its metrics.json
    settings: dict  # the report settings, drafters in config order
    trust: dict  # the trust panel (trust.json): online vs offline, outages, ...

    def chain(self, drafter: str, dataset: str) -> dict:
        """The own-block chain of one evaluation (acceptance by position, histogram); {} when absent."""
        return (self.metrics.get((drafter, dataset)) or {}).get("chain") or {}


@dataclass(frozen=True)
class Plot:
    """One registered plot: the PNG's name in the plot folder, how to draw it, its caption in workflow/report/."""

    file: str
    draw: Callable[[PlotData], Any]  # returns a matplotlib Figure
    caption: str


def png(plot: Plot, data: PlotData) -> bytes:
    """The plot as PNG bytes (written by the stage once every output is rendered)."""
    buffer = io.BytesIO()
    plot.draw(data).savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _whole_number_ticks(axes: Any) -> None:
    """Draft positions and acceptance lengths are whole numbers: no 1.25 ticks."""
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _figure() -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")


def _colors(count: int) -> list:
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    return [colormaps["viridis"](i / max(count - 1, 1)) for i in range(count)]


def _nothing_to_show(axes: Any, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", fontsize=14, wrap=True, transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def _legend(axes: Any, title: str) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(title=title, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def chain_rows(rows: list[dict]) -> list[dict]:
    """Each drafter's own chain (block size B): the headline number of the plots."""
    return [r for r in rows if r["primary"]]


def _error_bars(rows: list[dict]) -> list[list[float]]:
    """Distances below and above tau; 0 where the CI is unknown, so the bar still draws."""
    below, above = [], []
    for r in rows:
        tau, low, high = r["tau_mean_of_samples"], r["ci_low"], r["ci_high"]
        known = not (missing(tau) or missing(low) or missing(high))
        below.append(max(tau - low, 0.0) if known else 0.0)
        above.append(max(high - tau, 0.0) if known else 0.0)
    return [below, above]


def draw_tau(data: PlotData) -> Any:
    """Grouped bars: datasets along x, one bar per drafter (own chain), 95% CI as error bars."""
    settings = data.settings
    chain = chain_rows(data.rows)
    drafters, datasets = list(settings["drafters"]), list(settings["datasets"])
    figure = _figure()
    axes = figure.subplots()
    width = 0.8 / len(drafters)
    label_bars = len(drafters) * len(datasets) <= 30
    for index, (drafter, color) in enumerate(zip(drafters, _colors(len(drafters)))):
        mine = {r["dataset"]: r for r in chain if r["drafter"] == drafter}
        present = [d for d in datasets if d in mine]
        xs = [datasets.index(d) + (index - (len(drafters) - 1) / 2) * width for d in present]
        values = [0.0 if missing(mine[d]["tau_mean_of_samples"]) else mine[d]["tau_mean_of_samples"] for d in present]
        bars = axes.bar(
            xs,
            values,
            width * 0.92,
            yerr=_error_bars([mine[d] for d in present]),
            capsize=3,
            color=color,
            label=drafter_label(drafter, settings),
            hatch="//" if drafter == settings.get("reference") else None,
        )
        if label_bars:
            labels = [
                fmt(mine[d]["tau_mean_of_samples"]) + (" ⚠" if mine[d]["backend_mismatch_allowed"] else "")
                for d in present
            ]
            axes.bar_label(bars, labels=labels, padding=2, fontsize=8)
    axes.set_xticks(range(len(datasets)), datasets)
    axes.set_xlabel("dataset")
    axes.set_ylabel(TAU_LABEL)
    title = "DFlash drafters: tau (z-lab mean, own block size) with 95% bootstrap CI"
    if any(r["backend_mismatch_allowed"] for r in chain):
        title += "\n⚠ = hidden states from other kernels than the drafter was trained with (see summary.md)"
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    _legend(axes, "drafter")
    return figure


def training_runs(rows: list[dict], settings: dict) -> dict[str, list[dict]]:
    """Own-chain rows with a known step, grouped by the drafters' `run` (config order)."""
    runs: dict[str, list[dict]] = {}
    for row in chain_rows(rows):
        if missing(row["training_step"]):
            continue
        run = settings["drafters"].get(row["drafter"], {}).get("run") or DEFAULT_RUN
        runs.setdefault(run, []).append(row)
    return runs


def draw_tau_vs_step(data: PlotData) -> Any:
    """tau against training step, one line per training run and dataset, the 95% CI as a band."""
    figure = _figure()
    axes = figure.subplots()
    runs = training_runs(data.rows, data.settings)
    lines = [(run, dataset) for run in runs for dataset in data.settings["datasets"]]
    several_runs = len(runs) > 1
    drawn = 0
    for (run, dataset), color in zip(lines, _colors(len(lines))):
        points = sorted((r for r in runs[run] if r["dataset"] == dataset), key=lambda r: r["training_step"])
        if len(points) < 2:
            continue
        steps = [int(r["training_step"]) for r in points]
        label = f"{run} / {dataset}" if several_runs else dataset
        axes.plot(steps, [r["tau_mean_of_samples"] for r in points], marker="o", color=color, label=label)
        axes.fill_between(steps, [r["ci_low"] for r in points], [r["ci_high"] for r in points], color=color, alpha=0.2)
        for best in (r for r in points if r.get("best_step") is True):  # report/best_checkpoint.py's choice
            axes.plot(
                [int(best["training_step"])],
                [best["tau_mean_of_samples"]],
                marker="*",
                markersize=18,
                color=color,
                markeredgecolor="black",
                linestyle="none",
            )
        drawn += 1
    if not drawn:
        _nothing_to_show(
            axes,
            "No training run with two or more checkpoints of known step:\n"
            "set drafters.<name>.step (and drafters.<name>.run) in config.yaml",
        )
    else:
        axes.set_xlabel("training step (optimizer steps)")
        axes.set_ylabel(TAU_LABEL)
        axes.grid(alpha=0.3)
        _legend(axes, "training run / dataset" if several_runs else "dataset")
    axes.set_title(
        "DFlash drafters: tau (z-lab mean, own block size) against training step, 95% CI band\n"
        "★ best step of its run (paired against the runner-up in summary.md)"
    )
    return figure


def temperature_families(rows: list[dict], settings: dict) -> dict[str, list[dict]]:
    """Own-chain target_only rows by their dataset's prompt set (report settings' dataset_prompts), only the sets
    evaluated at two or more temperatures (greedy is T 0), each sorted by temperature: tau against temperature."""
    sources = settings.get("dataset_prompts") or {}
    families: dict[str, list[dict]] = {}
    for row in chain_rows(rows):
        temperature = row.get("temperature", 0.0)
        if row.get("scheme", TARGET_ONLY) != TARGET_ONLY or missing(temperature) or row["dataset"] not in sources:
            continue  # several sampling sets in one dataset (NaN) have no one temperature
        families.setdefault(sources[row["dataset"]], []).append(row)
    return {
        source: sorted(members, key=lambda r: float(r.get("temperature", 0.0)))
        for source, members in families.items()
        if len({float(r.get("temperature", 0.0)) for r in members}) >= 2
    }


def draw_tau_vs_temperature(data: PlotData) -> Any:
    """One panel per prompt set fetched at several temperatures: tau (z-lab mean, own block, SGLang's target_only
    verification) against the temperature, one line per drafter, the 95% CI as error bars, greedy at T 0."""
    settings = data.settings
    families = temperature_families(data.rows, settings)
    figure = _figure()
    title = "DFlash drafters: tau (z-lab mean, own block size, target_only verification) against temperature, 95% CI"
    if not families:
        _nothing_to_show(
            figure.subplots(),
            "No prompt set evaluated at several temperatures: add a dataset of the "
            "same prompts with temperature > 0 (docs/sampling.md)",
        )
        figure.suptitle(title)
        return figure
    drafters = list(settings["drafters"])
    panels = figure.subplots(1, len(families), squeeze=False, sharey=True)[0]
    for axes, (source, members) in zip(panels, families.items()):
        temperatures = sorted({float(r.get("temperature", 0.0)) for r in members})
        for drafter, color in zip(drafters, _colors(len(drafters))):
            mine = [r for r in members if r["drafter"] == drafter and not missing(r["tau_mean_of_samples"])]
            if not mine:
                continue
            axes.errorbar(
                [float(r.get("temperature", 0.0)) for r in mine],
                [r["tau_mean_of_samples"] for r in mine],
                yerr=_error_bars(mine),
                marker="o",
                capsize=3,
                color=color,
                label=drafter_label(drafter, settings),
            )
        axes.set_xticks(temperatures, [f"{t:g}" + (" (greedy)" if t == 0 else "") for t in temperatures])
        axes.set_title(source, fontsize=10)
        axes.set_xlabel("sampling temperature T")
        axes.grid(alpha=0.3)
    panels[0].set_ylabel(TAU_LABEL)
    figure.suptitle(title)
    _legend(panels[-1], "drafter")
    return figure


def _dataset_axes(figure: Any, datasets: list[str]) -> list[Any]:
    axes = figure.subplots(1, len(datasets), squeeze=False, sharey=True)[0]
    return list(axes)


def draw_acceptance_by_position(data: PlotData) -> Any:
    """Per dataset: share of verification steps that accept draft token k, one line per drafter."""
    settings = data.settings
    datasets, drafters = list(settings["datasets"]), list(settings["drafters"])
    figure = _figure()
    for axes, dataset in zip(_dataset_axes(figure, datasets), datasets):
        for drafter, color in zip(drafters, _colors(len(drafters))):
            shares = data.chain(drafter, dataset).get("acceptance_by_position") or []
            if not shares:
                continue
            percent = [float("nan") if missing(s) else 100 * float(s) for s in shares]
            axes.plot(
                range(1, len(percent) + 1), percent, marker="o", color=color, label=drafter_label(drafter, settings)
            )
        axes.set_title(dataset)
        axes.set_xlabel("draft position k (k-th token after the bonus token)")
        _whole_number_ticks(axes)
        axes.set_ylim(0, 100)
        axes.grid(alpha=0.3)
    figure.axes[0].set_ylabel("verification steps accepting draft token k (%)")
    figure.suptitle("Acceptance by draft position (own block size, greedy verification)")
    _legend(figure.axes[-1], "drafter")
    return figure


def draw_acceptance_histogram(data: PlotData) -> Any:
    """Per dataset: share of verification steps producing each length 1..B, grouped bars per drafter."""
    settings = data.settings
    datasets, drafters = list(settings["datasets"]), list(settings["drafters"])
    figure = _figure()
    width = 0.8 / len(drafters)
    for axes, dataset in zip(_dataset_axes(figure, datasets), datasets):
        lengths: set[int] = set()
        for index, (drafter, color) in enumerate(zip(drafters, _colors(len(drafters)))):
            counts = {int(k): int(v) for k, v in (data.chain(drafter, dataset).get("histogram") or {}).items()}
            total = sum(counts.values())
            if not total:
                continue
            lengths |= set(counts)
            xs = sorted(counts)
            offset = (index - (len(drafters) - 1) / 2) * width
            axes.bar(
                [x + offset for x in xs],
                [100 * counts[x] / total for x in xs],
                width * 0.92,
                color=color,
                label=drafter_label(drafter, settings),
            )
        if lengths:
            axes.set_xticks(sorted(lengths))
        axes.set_title(dataset)
        axes.set_xlabel("acceptance length (tokens per verification step)")
        _whole_number_ticks(axes)
        axes.grid(axis="y", alpha=0.3)
        axes.set_axisbelow(True)
    figure.axes[0].set_ylabel("share of verification steps (%)")
    figure.suptitle("Acceptance-length histogram (own block size)")
    _legend(figure.axes[-1], "drafter")
    return figure


SPEEDUP_LABEL = "expected speedup (estimate,\nx plain decoding)"
BUDGET_LABEL = "DDTree budget N (tree nodes besides the root)"
NO_PROFILE_TEXT = (
    "No expected speedup: it needs a serving profile (speedup.profile, measured on your deployment; "
    "or extraction on CUDA, speedup.measure)"
)


def ddtree_rows(rows: list[dict], drafter: str, dataset: str) -> list[dict]:
    """One evaluation's DDTree rows, by budget."""
    trees = [r for r in rows if r["drafter"] == drafter and r["dataset"] == dataset and is_kind(r["method"], TREE.name)]
    return sorted(trees, key=lambda r: int(r["budget"]))


def _budget_axis(axes: Any, budgets: list[int]) -> None:
    """Budgets double (8, 16, ..., 1024): a log-2 axis with a tick at each one evaluated."""
    from matplotlib.ticker import NullLocator

    axes.set_xscale("log", base=2)
    axes.set_xticks(budgets, [str(b) for b in budgets])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.grid(alpha=0.3)


def _budget_curve(axes: Any, trees: list[dict], value: str, chain: dict | None, color: Any, label: str) -> bool:
    """One drafter's line against the budget, its best budget starred, its own chain dashed; False if nothing."""
    points = [(int(r["budget"]), r[value]) for r in trees if not missing(r[value])]
    if not points:
        return False
    axes.plot(*zip(*points), marker="o", color=color, label=label)
    best = trees[0]["best_ddtree_budget"]
    if not missing(best) and int(best) in dict(points):
        axes.plot(
            [int(best)],
            [dict(points)[int(best)]],
            marker="*",
            markersize=18,
            color=color,
            markeredgecolor="black",
            linestyle="none",
        )
    if chain is not None and not missing(chain[value]):
        axes.axhline(chain[value], color=color, linestyle="--", alpha=0.6)
    return True


def draw_speedup(data: PlotData) -> Any:
    """Per dataset: tau (token-weighted) and the expected speedup against the DDTree budget, one line per
    drafter, the best budget by expected speedup starred, each drafter's own chain dashed. Without any
    estimate (no serving profile) only tau is drawn, and the title says what the speedup needs."""
    settings = data.settings
    datasets, drafters = list(settings["datasets"]), list(settings["drafters"])
    figure = _figure()
    trees = [r for r in data.rows if is_kind(r["method"], TREE.name)]
    title = "DDTree: tau and expected speedup (an estimate) against the budget"
    if not trees:
        _nothing_to_show(figure.subplots(), "No DDTree budget evaluated: set evaluation.ddtree_budgets in config.yaml")
        figure.suptitle(title)
        return figure
    sources = sorted({r["speedup_source"] for r in trees if not missing(r["expected_speedup"])})
    grid = figure.subplots(2 if sources else 1, len(datasets), squeeze=False)
    for column, dataset in enumerate(datasets):
        budgets: set[int] = set()
        estimated = False
        for drafter, color in zip(drafters, _colors(len(drafters))):
            mine = ddtree_rows(trees, drafter, dataset)
            if not mine:
                continue
            budgets |= {int(r["budget"]) for r in mine}
            chain = next(
                (r for r in data.rows if r["drafter"] == drafter and r["dataset"] == dataset and r["primary"]), None
            )
            label = drafter_label(drafter, settings)
            _budget_curve(grid[0][column], mine, "tau_token_weighted", chain, color, label)
            if sources:
                estimated |= _budget_curve(grid[1][column], mine, "expected_speedup", chain, color, label)
        hypothetical = any(samples(r) for r in trees if r["dataset"] == dataset)
        grid[0][column].set_title(f"{dataset} †" if hypothetical else dataset)
        for axes in grid[:, column]:
            _budget_axis(axes, sorted(budgets))
        grid[-1][column].set_xlabel(BUDGET_LABEL)
        if sources and not estimated:
            _nothing_to_show(grid[1][column], f"no expected speedup on {dataset}:\nno serving profile")
    grid[0][0].set_ylabel("tau, token-weighted\n(tokens per step)")
    if sources:
        grid[1][0].set_ylabel(SPEEDUP_LABEL)
        figure.suptitle(f"{title}\n★ best budget by expected speedup, dashed: own chain; source: {', '.join(sources)}")
    else:
        figure.suptitle(f"DDTree: tau against the budget (dashed: own chain)\n{NO_PROFILE_TEXT}")
    if any(samples(r) for r in trees):
        figure.text(0.5, 0.005, HYPOTHETICAL_TREE, ha="center", va="bottom", fontsize=8, wrap=True)
    _legend(grid[0][-1], "drafter")
    return figure


# name (the report rule's output name) -> plot, in the order of the HTML report's Plots
PLOTS: dict[str, Plot] = {
    "tau": Plot("tau.png", draw_tau, "tau.rst"),
    "tau_vs_step": Plot("tau_vs_step.png", draw_tau_vs_step, "tau_vs_step.rst"),
    "tau_vs_temperature": Plot("tau_vs_temperature.png", draw_tau_vs_temperature, "tau_vs_temperature.rst"),
    "acceptance_by_position": Plot(
        "acceptance_by_position.png", draw_acceptance_by_position, "acceptance_by_position.rst"
    ),
    "acceptance_histogram": Plot("acceptance_histogram.png", draw_acceptance_histogram, "acceptance_histogram.rst"),
    "speedup": Plot("speedup.png", draw_speedup, "speedup.rst"),
}
