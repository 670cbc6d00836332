"""The expected speedup in the report: summary.csv's appended columns, summary.md's section and the
budget plot, with a user profile (hand-computed numbers) and without one (the CPU demo: said, not invented)."""

from __future__ import annotations

import json

import matplotlib.image
import pandas as pd
import pytest
from matplotlib.text import Text

from dflash_eval.io_utils import atomic_write_json
from dflash_eval.report import metrics_files, plots, summary
from dflash_eval.report import speedup as report_speedup
from dflash_eval.report import stage as report
from tests.support.report_inputs import (
    TAUS,
    metrics_dict,
    report_args,
    section,
    write_metrics,
)

# summary.csv's columns before the estimate: kept first and in this order, so that a reader of the earlier file
# (and the demo's summary.csv) sees the same columns and values
EARLIER_COLUMNS = [
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
]

# T_AR 20 ms, T_draft 5 ms, T_verify by tokens verified (every size a method here verifies is listed)
PROFILE = {"t_ar_ms": 20.0, "t_draft_ms": 5.0, "t_verify_ms": {"1": 20, "2": 21, "4": 22, "9": 23, "17": 25, "33": 30}}
# token-weighted tau of ddtree-16 and ddtree-32 per drafter (ddtree-8 is the fixtures' chain-B4 tau + 1)
TREE_TAUS = {"step-1000": (6.0, 6.5), "step-2000": (6.0, 8.0)}
BEST = {
    ("step-1000", "gsm8k"): 16,
    ("step-1000", "humaneval"): 16,  # by hand: see the test of the CSV
    ("step-2000", "gsm8k"): 8,
    ("step-2000", "humaneval"): 32,
}


def _with_profile(args, profile):
    """The report's arguments naming the user's profile (what the workflow passes for speedup.profile)."""
    args.user_profile = str(profile)
    return args


def _with_trees(drafter: str, dataset: str) -> dict:
    metrics = metrics_dict(drafter, dataset)
    tree = metrics["methods"]["ddtree-8"]
    for budget, tau in zip((16, 32), TREE_TAUS[drafter]):
        metrics["methods"][f"ddtree-{budget}"] = {
            **tree,
            "method": f"ddtree-{budget}",
            "budget": budget,
            "tau_token_weighted": tau,
        }
    return metrics


def _expected(drafter: str, dataset: str) -> dict[str, float]:
    """By hand: tau x 20 / (5 + T_verify(n)), n = b for chain-B<b>, N + 1 for ddtree-N."""
    tau_tw = TAUS[(drafter, dataset)][1]
    tree16, tree32 = TREE_TAUS[drafter]
    return {
        "chain-B2": tau_tw / 2 * 20 / 26,
        "chain-B4": tau_tw * 20 / 27,
        "ddtree-8": (tau_tw + 1) * 20 / 28,
        "ddtree-16": tree16 * 20 / 30,
        "ddtree-32": tree32 * 20 / 35,
    }


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A report that makes its evaluations' expected speedup from a user profile."""
    root = tmp_path_factory.mktemp("speedup")
    profile = root / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    paths = write_metrics(root)
    for path in paths:
        metrics = json.loads(path.read_text())
        metrics["methods"] = _with_trees(metrics["drafter"], metrics["dataset"])["methods"]
        metrics["speedup"] = {"estimate": True, "draft_timing": None}  # the profile gives t_draft_ms
        atomic_write_json(path, metrics)
    assert report.run(_with_profile(report_args(root, paths), profile)) == 0
    return root


def test_csv_appends_the_estimate_after_the_earlier_columns(out):
    assert summary.COLUMNS[: len(EARLIER_COLUMNS)] == EARLIER_COLUMNS
    assert summary.COLUMNS[len(EARLIER_COLUMNS) :] == ["expected_speedup", "speedup_source", "best_ddtree_budget"]
    assert list(pd.read_csv(out / "summary.csv").columns) == summary.COLUMNS + summary.HANDOFF_COLUMNS


def test_no_profile_leaves_the_estimate_empty_and_says_so(out):
    table = pd.read_csv(out / "summary.csv", keep_default_na=False)
    assert set(table.expected_speedup) == {""} and set(table.best_ddtree_budget) == {""}
    assert set(table.speedup_source) == {"no profile"}
    text = section((out / "summary.md").read_text(), "## Expected speedup (an estimate)")
    assert "No expected speedup (no profile): it needs a serving profile" in text and "×" not in text


def test_user_profile_estimates_by_hand_and_the_best_budget(profiled):
    table = pd.read_csv(profiled / "summary.csv")
    assert set(table.speedup_source) == {"user profile"}
    for row in table.itertuples():
        assert row.expected_speedup == pytest.approx(_expected(row.drafter, row.dataset)[row.method])
    best = {(r.drafter, r.dataset): r.best_ddtree_budget for r in table.itertuples()}
    # step-1000: ddtree-16 6.0 x 20 / 30 = 4.00 beats ddtree-32 6.5 x 20 / 35 = 3.71 and ddtree-8 (4.3 + 1) x 20 / 28
    # = 3.79 (gsm8k; humaneval 3.57); step-2000: ddtree-8 (5.5 + 1) x 20 / 28 = 4.64 beats ddtree-32 8.0 x 20 / 35 =
    # 4.57 on gsm8k, while on humaneval ddtree-8 gives (3.6 + 1) x 20 / 28 = 3.29 and ddtree-32 wins
    assert best == BEST


def test_markdown_shows_the_estimate_labelled_with_its_source(profiled):
    markdown = (profiled / "summary.md").read_text()
    text = markdown.split("## Expected speedup (an estimate)", 1)[1].split("\n## ", 1)[0]
    assert "Expected speedup (estimate) = tau_token_weighted x T_AR / (T_draft + T_verify(n))" in text
    assert "token-weighted" in text and "not a measured throughput" in text
    grid = next(line for line in text.splitlines() if line.startswith("| step-2000"))
    assert f"**{8 * 20 / 35:.2f}×**" in grid  # humaneval ddtree-32, best in its column
    best = section(markdown, "### Best DDTree budget by expected speedup")
    line = next(line for line in best.splitlines() if line.startswith("| step-2000 | humaneval"))
    assert (
        line == f"| step-2000 | humaneval | **32** | {8 * 20 / 35:.2f}× | 8.00 | {3.6 * 20 / 27:.2f}× | user profile |"
    )
    assert f"- target step: user profile {profiled / 'profile.json'}; drafter step: user profile" in markdown


def test_budget_plot_is_drawn_with_and_without_a_profile(profiled, out):
    for root in (profiled, out):
        pixels = matplotlib.image.imread(root / "plots" / plots.PLOTS["speedup"].file)
        assert pixels.shape[:2] == (600, 1200) and pixels[..., :3].var() > 0
    rows = summary.summary_rows(
        metrics_files.collect(_settings(out), sorted((out / "eval").glob("*/*/metrics.json"))), _settings(out)
    )
    shown = _texts(plots.draw_speedup(plots.PlotData(rows=rows, metrics={}, settings=_settings(out), trust={})))
    assert any(plots.NO_PROFILE_TEXT in t for t in shown) and "★" not in " ".join(shown)
    evaluations = metrics_files.collect(_settings(profiled), sorted((profiled / "eval").glob("*/*/metrics.json")))
    target, source, stamp = report_speedup.load_target_profile(profiled / "profile.json", True)
    for evaluation in evaluations:  # as the report stage does: the estimate made from metrics.json and the profile
        report_speedup.apply(evaluation.metrics, target, source, True, stamp)
    rows = summary.summary_rows(evaluations, _settings(profiled))
    figure = plots.draw_speedup(plots.PlotData(rows=rows, metrics={}, settings=_settings(profiled), trust={}))
    assert not any(plots.NO_PROFILE_TEXT in t for t in _texts(figure))
    assert any("source: user profile" in t for t in _texts(figure))
    speed_axes = figure.axes[len(_settings(profiled)["datasets"]) :]  # the bottom row
    stars = [line for axes in speed_axes for line in axes.get_lines() if line.get_marker() == "*"]
    assert sorted((int(s.get_xdata()[0]), round(float(s.get_ydata()[0]), 4)) for s in stars) == sorted(
        (budget, round(_expected(*key)[f"ddtree-{budget}"], 4)) for key, budget in BEST.items()
    )


def _settings(root) -> dict:
    from tests.support.report_inputs import SETTINGS

    return metrics_files.ordered_settings({**SETTINGS, "drafter_order": list(SETTINGS["drafters"])})


def _texts(figure) -> list[str]:
    return [text.get_text() for text in figure.findobj(Text)]


def test_unmeasured_sizes_and_the_hybrid_tree_assumption_are_said(tmp_path):
    """A method whose size the profile lacks, and DDTree priced on a hybrid target: summary.md says both."""
    root = tmp_path
    profile = root / "profile.json"
    profile.write_text(
        json.dumps(
            {**PROFILE, "hybrid": True, "t_verify_ms": {k: v for k, v in PROFILE["t_verify_ms"].items() if k != "33"}}
        )
    )
    paths = write_metrics(root)
    for path in paths:
        metrics = json.loads(path.read_text())
        metrics["methods"] = _with_trees(metrics["drafter"], metrics["dataset"])["methods"]
        metrics["speedup"] = {"estimate": True, "draft_timing": None}  # the profile gives t_draft_ms
        atomic_write_json(path, metrics)
    assert report.run(_with_profile(report_args(root, paths), profile)) == 0
    text = (root / "summary.md").read_text()
    assert (
        "no estimate for ddtree-32: 33 verified tokens: not in the profile (sizes are measured, never "
        "interpolated)" in text
    )
    assert "cannot verify a tree in one causal pass" in text


def test_budget_plot_marks_ddtree_at_t_above_0_hypothetical(out):
    """As summary.md's † does: a dataset sampled at T > 0 gets † in its panel title and the note below the plot;
    the greedy datasets of the same plot do not."""
    rows = summary.summary_rows(
        metrics_files.collect(_settings(out), sorted((out / "eval").glob("*/*/metrics.json"))), _settings(out)
    )
    datasets = list(_settings(out)["datasets"])

    def titles(rows: list[dict]) -> tuple[list[str], list[str]]:
        figure = plots.draw_speedup(plots.PlotData(rows=rows, metrics={}, settings=_settings(out), trust={}))
        return [a.get_title() for a in figure.axes[: len(datasets)]], _texts(figure)

    greedy_titles, greedy_texts = titles(rows)
    assert greedy_titles == datasets and not any(plots.HYPOTHETICAL_TREE in t for t in greedy_texts)
    sampled = [{**r, "temperature": 0.7} if r["dataset"] == datasets[0] else r for r in rows]
    sampled_titles, sampled_texts = titles(sampled)
    assert sampled_titles == [f"{datasets[0]} †", *datasets[1:]]
    assert any(plots.HYPOTHETICAL_TREE in t for t in sampled_texts)
