"""The plots: every registered plot renders at 1200 x 600 px and is not blank; training runs get a line each."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from dflash_eval.report import plots


@pytest.mark.parametrize("name", sorted(plot.file for plot in plots.PLOTS.values()))
def test_plots_open_at_the_expected_size_and_are_not_blank(out, name):
    pixels = matplotlib.image.imread(out / "plots" / name)
    assert pixels.shape[:2] == (600, 1200)
    assert pixels[..., :3].var() > 0
    assert not list((out / "plots").glob(".*"))  # no temporary files left behind


def test_training_runs_get_one_line_each():
    rows = [
        {"drafter": d, "dataset": "x", "primary": True, "training_step": step}
        for d, step in (("a1", 100), ("a2", 200), ("b1", 100), ("c", None))
    ]
    settings = {"drafters": {"a1": {"run": "A"}, "a2": {"run": "A"}, "b1": {}, "c": {"run": "A"}}}
    runs = plots.training_runs(rows, settings)
    assert {run: [r["drafter"] for r in members] for run, members in runs.items()} == {
        "A": ["a1", "a2"],
        plots.DEFAULT_RUN: ["b1"],
    }


def test_every_registered_plot_has_a_caption_and_its_own_file():
    captions = Path(__file__).resolve().parents[2] / "workflow" / "report"
    for name, plot in plots.PLOTS.items():
        assert (captions / plot.caption).read_text().strip(), f"{name}: caption {plot.caption} is empty"
    files = [plot.file for plot in plots.PLOTS.values()]
    assert len(set(files)) == len(files) and all(file.endswith(".png") for file in files)


def _row(drafter: str, dataset: str, temperature: float, tau: float) -> dict:
    return {
        "drafter": drafter,
        "dataset": dataset,
        "primary": True,
        "scheme": "target_only",
        "temperature": temperature,
        "tau_mean_of_samples": tau,
        "ci_low": tau - 0.2,
        "ci_high": tau + 0.1,
        "backend_mismatch_allowed": False,
    }


def _temperature_data(rows: list[dict], prompts: dict[str, str]) -> plots.PlotData:
    settings = {"drafters": {"a": {}, "b": {}}, "datasets": list(prompts), "dataset_prompts": prompts}
    return plots.PlotData(rows=rows, metrics={}, settings=settings, trust={})


def test_tau_against_temperature_is_drawn_for_a_prompt_set_at_several_temperatures():
    """gsm8k greedy and at T 0.7 (one prompt set): one panel, a line per drafter through T 0 and 0.7 with the CI;
    another prompt set at one temperature only, shorter chains and rejection rows are left out."""
    prompts = {"gsm8k": "preset gsm8k", "gsm8k-t07": "preset gsm8k", "code-t07": "prompts code.jsonl"}
    rows = [
        _row(d, ds, t, tau)
        for d in "ab"
        for ds, t, tau in (("gsm8k", 0.0, 6.0), ("gsm8k-t07", 0.7, 4.5), ("code-t07", 0.7, 3.0))
    ]
    rows += [
        {**_row("a", "gsm8k-t07", 0.7, 9.0), "primary": False},
        {**_row("a", "gsm8k-t07", 0.7, 9.0), "scheme": "rejection"},
    ]
    families = plots.temperature_families(rows, _temperature_data(rows, prompts).settings)
    assert list(families) == ["preset gsm8k"]
    assert [(r["drafter"], r["temperature"]) for r in families["preset gsm8k"]] == [
        ("a", 0.0),
        ("b", 0.0),
        ("a", 0.7),
        ("b", 0.7),
    ]
    figure = plots.draw_tau_vs_temperature(_temperature_data(rows, prompts))
    (axes,) = figure.axes
    drawn = [
        (bars.get_label(), list(bars.lines[0].get_xdata()), list(bars.lines[0].get_ydata())) for bars in axes.containers
    ]  # one errorbar line per drafter
    assert drawn == [("a", [0.0, 0.7], [6.0, 4.5]), ("b", [0.0, 0.7], [6.0, 4.5])]
    (intervals,) = axes.containers[0].lines[2]  # drafter a's CI bars: from ci_low to ci_high at each temperature
    np.testing.assert_allclose(np.array(intervals.get_segments()), [[[0.0, 5.8], [0.0, 6.1]], [[0.7, 4.3], [0.7, 4.6]]])
    assert [t.get_text() for t in axes.get_xticklabels()] == ["0 (greedy)", "0.7"]
    assert not axes.texts  # not the nothing-to-show message


def test_tau_against_temperature_says_why_without_a_prompt_set_at_several_temperatures():
    """Two temperatures of different prompt sets are no family; nor is a greedy-only report."""
    prompts = {"gsm8k": "preset gsm8k", "code-t07": "prompts code.jsonl"}
    rows = [_row("a", "gsm8k", 0.0, 6.0), _row("a", "code-t07", 0.7, 3.0)]
    for data in (_temperature_data(rows, prompts), _temperature_data(rows[:1], {"gsm8k": "preset gsm8k"})):
        assert plots.temperature_families(data.rows, data.settings) == {}
        (axes,) = plots.draw_tau_vs_temperature(data).axes
        assert not axes.get_lines() and "No prompt set evaluated at several temperatures" in axes.texts[0].get_text()
