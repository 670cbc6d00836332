"""The best step of a training run: named in summary.csv, summary.md, trust.json and starred on the plot.

The fixtures' two checkpoints (steps 1000 and 2000, no `run:`: one default run): on gsm8k step 2000 gains 1 on
every sample (paired difference +1, interval [1, 1]: better); on humaneval step 1000 has the higher tau, and
step 2000 gains 1 on half the samples and loses 1 on the other half (difference 0: within noise).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dflash_eval.report import best_checkpoint, metrics_files, plots, summary
from tests.support.report_inputs import SETTINGS, section, write_metrics


def test_summary_csv_marks_the_best_step_and_its_paired_difference(out):
    frame = pd.read_csv(out / "summary.csv")
    chains = frame[frame["primary"]].set_index(["drafter", "dataset"])
    assert chains.loc[("step-2000", "gsm8k"), "best_step"] == True  # noqa: E712 (a CSV cell)
    assert chains.loc[("step-1000", "gsm8k"), "best_step"] == False  # noqa: E712
    assert chains.loc[("step-2000", "gsm8k"), "runner_up"] == "step-1000"
    assert chains.loc[
        ("step-2000", "gsm8k"), ["diff_vs_runner_up", "runner_up_ci_low", "runner_up_ci_high"]
    ].tolist() == [1.0, 1.0, 1.0]
    assert chains.loc[("step-1000", "humaneval"), "best_step"] == True  # noqa: E712
    assert chains.loc[("step-1000", "humaneval"), "diff_vs_runner_up"] == 0.0
    others = frame[~frame["primary"]]
    assert others["best_step"].isna().all() and others["runner_up"].isna().all()


def test_the_verdict_is_a_plain_sentence(out):
    text = section((out / "summary.md").read_text(), "## Best checkpoint per training run")
    assert (
        "training run on gsm8k: step 2000 (step-2000) is best, tau 5.250; it beats the runner-up, step 1000 "
        "(tau 4.100), by +1.000 (paired 95% CI [+1.000, +1.000] over 10 samples)"
    ) in text
    assert (
        "training run on humaneval: step 1000 (step-1000) is best, tau 3.900; step 2000 (tau 3.500) is within noise"
        in text
    )
    trust = json.loads((out / "trust.json").read_text())["best_checkpoints"]
    assert [(b["dataset"], b["best"]["step"], b["runner_up"]["step"]) for b in trust] == [
        ("gsm8k", 2000, 1000),
        ("humaneval", 1000, 2000),
    ]


def test_the_plot_stars_each_lines_best_step(tmp_path):
    evaluations = metrics_files.collect(SETTINGS, write_metrics(tmp_path))
    rows = summary.summary_rows(evaluations, SETTINGS)
    found = best_checkpoint.mark(rows, evaluations, SETTINGS)
    figure = plots.draw_tau_vs_step(plots.PlotData(rows=rows, metrics={}, settings=SETTINGS, trust={}))
    stars = [line.get_xydata().tolist() for line in figure.axes[0].lines if line.get_marker() == "*"]
    assert stars == [[[2000.0, 5.25]], [[1000.0, 3.9]]]
    assert [b.dataset for b in found] == ["gsm8k", "humaneval"]


def test_one_checkpoint_is_no_run_to_choose_from(tmp_path):
    settings = {
        **SETTINGS,
        "drafters": {"step-1000": SETTINGS["drafters"]["step-1000"]},
        "reference": None,
        "served_drafter": None,
    }
    paths = [p for p in write_metrics(tmp_path) if p.parent.parent.name == "step-1000"]
    evaluations = metrics_files.collect(settings, paths)
    rows = summary.summary_rows(evaluations, settings)
    assert best_checkpoint.mark(rows, evaluations, settings) == []
    assert best_checkpoint.lines([]) == []
    assert all("best_step" not in row for row in rows)


@pytest.mark.parametrize(
    "low, high, words",
    [
        (0.5, 1.5, "beats the runner-up"),
        (-0.5, 1.5, "within noise"),
        (float("nan"), float("nan"), "could not be paired"),
    ],
)
def test_the_verdict_follows_the_interval(low, high, words):
    row = {"drafter": "a", "training_step": 2, "tau_mean_of_samples": 3.0, "method": "chain-B4"}
    best = best_checkpoint.Best("run", "x", row, {**row, "drafter": "b", "training_step": 1}, 1.0, (low, high), 5)
    assert words in best.verdict
