"""The report's PNG plots: tau by drafter and dataset, tau against training step, acceptance by
position, and the acceptance-length histogram.

Every plot is drawn on a pyplot-free Figure (no global state; PNG goes through Agg whatever the
backend), 1200 x 600 px, axes labelled with units, and written to a temporary name then renamed.
A plot with nothing to show (no training steps known) still renders, saying why, so that the
workflow can declare every plot as an output.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from dflash_eval.io_utils import _umask

TAU_LABEL = "acceptance length tau (tokens per verification step)"
FIGSIZE, DPI = (12, 6), 100          # 1200 x 600 px
DIGITS = 2                           # tau precision shown; the CI is wider than 0.01 in practice
DEFAULT_RUN = "training run"         # label of the drafters that name no `run:`
NAMES = {"tau": "tau.png", "step": "tau_vs_step.png", "position": "acceptance_by_position.png",
         "histogram": "acceptance_histogram.png"}


def missing(value: Any) -> bool:
    return value is None or bool(pd.isna(value))


def fmt(value: Any, digits: int = DIGITS) -> str:
    return "n/a" if missing(value) else f"{value:.{digits}f}"


def drafter_label(drafter: str, settings: dict) -> str:
    return f"{drafter} (reference)" if drafter == settings.get("reference") else drafter


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


def save_png(figure: Any, path: str | Path) -> None:
    """Render to a temporary sibling and rename, so a crash never leaves a half-written PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        figure.savefig(tmp, format="png", dpi=DPI)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def plot_tau(rows: list[dict], settings: dict, path: str | Path) -> None:
    """Grouped bars: datasets along x, one bar per drafter (own chain), 95% CI as error bars."""
    chain = chain_rows(rows)
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
        bars = axes.bar(xs, values, width * 0.92, yerr=_error_bars([mine[d] for d in present]), capsize=3,
                        color=color, label=drafter_label(drafter, settings),
                        hatch="//" if drafter == settings.get("reference") else None)
        if label_bars:
            labels = [fmt(mine[d]["tau_mean_of_samples"]) + (" ⚠" if mine[d]["backend_mismatch_allowed"] else "")
                      for d in present]
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
    save_png(figure, path)


def training_runs(rows: list[dict], settings: dict) -> dict[str, list[dict]]:
    """Own-chain rows with a known step, grouped by the drafters' `run` (config order)."""
    runs: dict[str, list[dict]] = {}
    for row in chain_rows(rows):
        if missing(row["training_step"]):
            continue
        run = settings["drafters"].get(row["drafter"], {}).get("run") or DEFAULT_RUN
        runs.setdefault(run, []).append(row)
    return runs


def plot_tau_vs_step(rows: list[dict], settings: dict, path: str | Path) -> None:
    """tau against training step, one line per training run and dataset, the 95% CI as a band."""
    figure = _figure()
    axes = figure.subplots()
    runs = training_runs(rows, settings)
    lines = [(run, dataset) for run in runs for dataset in settings["datasets"]]
    several_runs = len(runs) > 1
    drawn = 0
    for (run, dataset), color in zip(lines, _colors(len(lines))):
        points = sorted((r for r in runs[run] if r["dataset"] == dataset), key=lambda r: r["training_step"])
        if len(points) < 2:
            continue
        steps = [int(r["training_step"]) for r in points]
        label = f"{run} / {dataset}" if several_runs else dataset
        axes.plot(steps, [r["tau_mean_of_samples"] for r in points], marker="o", color=color, label=label)
        axes.fill_between(steps, [r["ci_low"] for r in points], [r["ci_high"] for r in points], color=color,
                          alpha=0.2)
        drawn += 1
    if not drawn:
        _nothing_to_show(axes, "No training run with two or more checkpoints of known step:\n"
                               "set drafters.<name>.step (and drafters.<name>.run) in config.yaml")
    else:
        axes.set_xlabel("training step (optimizer steps)")
        axes.set_ylabel(TAU_LABEL)
        axes.grid(alpha=0.3)
        _legend(axes, "training run / dataset" if several_runs else "dataset")
    axes.set_title("DFlash drafters: tau (z-lab mean, own block size) against training step, 95% CI band")
    save_png(figure, path)


def _dataset_axes(figure: Any, datasets: list[str]) -> list[Any]:
    axes = figure.subplots(1, len(datasets), squeeze=False, sharey=True)[0]
    return list(axes)


def plot_acceptance_by_position(chains: dict[tuple[str, str], dict], settings: dict, path: str | Path) -> None:
    """Per dataset: share of verification steps that accept draft token k, one line per drafter."""
    datasets, drafters = list(settings["datasets"]), list(settings["drafters"])
    figure = _figure()
    for axes, dataset in zip(_dataset_axes(figure, datasets), datasets):
        for drafter, color in zip(drafters, _colors(len(drafters))):
            shares = (chains.get((drafter, dataset)) or {}).get("acceptance_by_position") or []
            if not shares:
                continue
            percent = [float("nan") if missing(s) else 100 * float(s) for s in shares]
            axes.plot(range(1, len(percent) + 1), percent, marker="o",
                      color=color, label=drafter_label(drafter, settings))
        axes.set_title(dataset)
        axes.set_xlabel("draft position k (k-th token after the bonus token)")
        _whole_number_ticks(axes)
        axes.set_ylim(0, 100)
        axes.grid(alpha=0.3)
    figure.axes[0].set_ylabel("verification steps accepting draft token k (%)")
    figure.suptitle("Acceptance by draft position (own block size, greedy verification)")
    _legend(figure.axes[-1], "drafter")
    save_png(figure, path)


def plot_acceptance_histogram(chains: dict[tuple[str, str], dict], settings: dict, path: str | Path) -> None:
    """Per dataset: share of verification steps producing each length 1..B, grouped bars per drafter."""
    datasets, drafters = list(settings["datasets"]), list(settings["drafters"])
    figure = _figure()
    width = 0.8 / len(drafters)
    for axes, dataset in zip(_dataset_axes(figure, datasets), datasets):
        lengths: set[int] = set()
        for index, (drafter, color) in enumerate(zip(drafters, _colors(len(drafters)))):
            counts = {int(k): int(v) for k, v in ((chains.get((drafter, dataset)) or {}).get("histogram") or {}).items()}
            total = sum(counts.values())
            if not total:
                continue
            lengths |= set(counts)
            xs = sorted(counts)
            offset = (index - (len(drafters) - 1) / 2) * width
            axes.bar([x + offset for x in xs], [100 * counts[x] / total for x in xs], width * 0.92, color=color,
                     label=drafter_label(drafter, settings))
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
    save_png(figure, path)


def write_all(rows: list[dict], chains: dict[tuple[str, str], dict], settings: dict, tau_path: str | Path,
              plot_dir: str | Path) -> list[Path]:
    """Every plot; tau.png where asked, the others in plot_dir under their fixed NAMES."""
    plot_dir = Path(plot_dir)
    paths = [Path(tau_path)] + [plot_dir / NAMES[key] for key in ("step", "position", "histogram")]
    plot_tau(rows, settings, paths[0])
    plot_tau_vs_step(rows, settings, paths[1])
    plot_acceptance_by_position(chains, settings, paths[2])
    plot_acceptance_histogram(chains, settings, paths[3])
    return paths
