"""summary.csv: the rows equal the metrics, verdicts against the reference; bad metrics are named."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.report import diagnostics_section, metrics_files, summary, tau_section
from dflash_eval.report import stage as report
from tests.support.report_inputs import (
    MISMATCH,
    SETTINGS,
    TAUS,
    metrics_dict,
    report_args,
    table_line,
    write_metrics,
)


def test_csv_numbers_equal_the_metrics(out):
    table = pd.read_csv(out / "summary.csv")
    assert list(table.columns) == summary.COLUMNS + summary.HANDOFF_COLUMNS
    assert list(zip(table.drafter, table.dataset, table.method)) == [
        (*key, method) for key in TAUS for method in ("chain-B2", "chain-B4", "ddtree-8")
    ]  # config order
    for row in table.itertuples():
        metrics = metrics_dict(row.drafter, row.dataset)
        chain = metrics["methods"][row.method]
        assert row.primary == (row.method == "chain-B4") and row.block_size == chain["block_size"]
        assert (pd.isna(row.budget) and chain["budget"] is None) or row.budget == chain["budget"]
        assert row.tau_mean_of_samples == chain["tau_mean_of_samples"]
        assert row.tau_token_weighted == chain["tau_token_weighted"]
        assert [row.ci_low, row.ci_high] == chain["ci95"]["tau_mean_of_samples"]
        assert [row.ci_low_tw, row.ci_high_tw] == chain["ci95"]["tau_token_weighted"]
        assert (row.samples, row.steps, row.tokens) == (chain["samples"], chain["steps"], chain["tokens"])
        assert row.training_step == (2000 if row.drafter == "step-2000" else 1000)
        assert row.layer_ids == "1 3"
        assert row.backend == metrics["cache"]["backend"]
        assert row.backend_mismatch_allowed == ((row.drafter, row.dataset) == MISMATCH)
        assert row.argmax_agreement == 0.9975
        reference = metrics_dict("step-1000", row.dataset)["methods"][row.method]["tau_mean_of_samples"]
        assert row.tau_vs_reference == pytest.approx(chain["tau_mean_of_samples"] / reference)


def test_paired_verdicts_against_the_reference(out):
    table = pd.read_csv(out / "summary.csv", keep_default_na=False)
    table = table[table.method == "chain-B4"]
    verdicts = {(r.drafter, r.dataset): r.verdict for r in table.itertuples()}
    assert verdicts[("step-2000", "gsm8k")] == "better"
    assert verdicts[("step-2000", "humaneval")] == "no clear difference"
    assert verdicts[("step-1000", "gsm8k")] == ""  # the reference itself
    row = table[(table.drafter == "step-2000") & (table.dataset == "gsm8k")].iloc[0]
    assert [float(row[c]) for c in ("diff_vs_reference", "diff_ci_low", "diff_ci_high")] == [1.0, 1.0, 1.0]
    markdown = (out / "summary.md").read_text()
    assert "## Verdicts against the reference (step-1000)" in markdown and "**better**" in markdown


def test_missing_metrics_file_is_named(tmp_path):
    paths = write_metrics(tmp_path)
    gone = tmp_path / "eval" / "step-2000" / "gsm8k" / "nope.json"
    with pytest.raises(DflashEvalError, match=f"not found: {gone}"):
        report.run(report_args(tmp_path, paths[:2] + [gone] + paths[3:]))
    assert not (tmp_path / "summary.csv").exists()


def test_missing_evaluation_names_drafter_and_dataset(tmp_path):
    paths = write_metrics(tmp_path)
    with pytest.raises(DflashEvalError, match="drafter 'step-2000' on dataset 'humaneval'"):
        report.run(report_args(tmp_path, paths[:3]))


def test_stale_layer_list_is_refused(tmp_path):
    settings = {**SETTINGS, "drafters": {**SETTINGS["drafters"], "step-1000": {"step": 1000, "layer_ids": [1, 2]}}}
    with pytest.raises(DflashEvalError, match=r"layer ids \[1, 3\] but the config says \[1, 2\]"):
        report.run(report_args(tmp_path, write_metrics(tmp_path), settings))


def test_an_empty_evaluation_reports_na_and_warns(tmp_path):
    paths = write_metrics(tmp_path)
    empty = metrics_dict("step-2000", "gsm8k")
    nan = float("nan")
    empty["chain"].update(
        tau_mean_of_samples=nan,
        tau_token_weighted=nan,
        samples=0,
        steps=0,
        tokens=0,
        ci95={"tau_mean_of_samples": [nan, nan], "tau_token_weighted": [nan, nan]},
    )
    empty["diagnostics"]["argmax_agreement"] = None
    atomic_write_json(paths[2], empty)  # json writes NaN, as evaluate does
    assert report.run(report_args(tmp_path, paths)) == 0
    markdown = (tmp_path / "summary.md").read_text()
    assert "**No samples**: step-2000 on gsm8k" in markdown
    assert "| **4.10** <sub>[3.90, 4.30]</sub>" in table_line(markdown, "## tau, z-lab mean", "step-1000")
    assert "| n/a |" in table_line(markdown, "## tau, z-lab mean", "step-2000")
    assert "n/a (no argmax stored)" in markdown
    table = pd.read_csv(tmp_path / "summary.csv")
    row = table[(table.drafter == "step-2000") & (table.dataset == "gsm8k") & (table.method == "chain-B4")].iloc[0]
    assert pd.isna(row.tau_mean_of_samples) and row.samples == 0


def test_a_sampled_evaluation_adds_its_scheme_and_parameters_and_a_greedy_one_keeps_the_columns(tmp_path):
    """Issue 25: summary.csv names temperature, top-p/k, min-p and the scheme once any evaluation sampled, and gives
    the rejection scheme's expected tau its own row (no integer steps: an expectation); a greedy-only summary keeps
    the columns it had, so its bytes do not change."""
    greedy = [metrics_files.read_metrics(path) for path in write_metrics(tmp_path)]  # in TAUS order, samples.csv beside
    frame = summary.summary_frame(summary.summary_rows(greedy, SETTINGS))
    assert list(frame.columns) == summary.COLUMNS + summary.HANDOFF_COLUMNS
    sampled = metrics_dict("step-1000", "gsm8k")
    sampled["sampling"] = [{"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0}]  # as evaluate writes it
    sampled["rejection"] = {
        "scheme": "rejection",
        "methods": {
            "chain-B4": {
                "method": "chain-B4",
                "scheme": "rejection",
                "block_size": 4,
                "tau_mean_of_samples": 2.5,
                "tau_token_weighted": 2.6,
                "ci95": {"tau_mean_of_samples": [2.2, 2.8], "tau_token_weighted": [2.3, 2.9]},
                "samples": 10,
                "expected_steps": 160.4,
                "tokens": 417,
            }
        },
    }
    evaluations = [metrics_files.Evaluation(greedy[0].path, sampled), *greedy[1:]]
    rows = summary.summary_rows(evaluations, SETTINGS)
    frame = summary.summary_frame(rows)
    assert list(frame.columns) == summary.COLUMNS + summary.SAMPLING_COLUMNS + summary.HANDOFF_COLUMNS
    mine = frame[(frame.drafter == "step-1000") & (frame.dataset == "gsm8k")]
    assert list(zip(mine.method, mine.scheme)) == [
        ("chain-B2", "target_only"),
        ("chain-B4", "target_only"),
        ("ddtree-8", "target_only"),
        ("chain-B4", "rejection"),
    ]
    rejection = mine[mine.scheme == "rejection"].iloc[0]
    assert (rejection.tau_mean_of_samples, rejection.ci_low, rejection.ci_high) == (2.5, 2.2, 2.8)
    assert pd.isna(rejection.steps) and rejection.tokens == 417 and not rejection.primary
    assert set(mine.temperature) == {0.7} and set(mine.top_p) == {0.95} and set(mine.top_k) == {-1}
    other = frame[(frame.drafter == "step-2000") & (frame.dataset == "gsm8k")]
    assert set(other.temperature) == {0.0} and set(other.scheme) == {"target_only"}
    # the reference's (step-1000's) rejection row is no baseline for step-2000's target_only rows
    assert other[other.primary].tau_vs_reference.iloc[0] == pytest.approx(5.25 / 4.1)
    lines = tau_section.rejection_table(rows, SETTINGS)
    served = mine[(mine.scheme == "target_only") & (mine.method == "chain-B4")].iloc[0]
    assert (
        f"| step-1000 (reference) | gsm8k | chain-B4 | T 0.7, top-p 0.95 | 4.10 | {served.samples} | 2.50 | "
        "2.20..2.80 | 10 | – |"
    ) in lines  # each scheme's samples; no outside_support in this metrics.json


def test_low_argmax_agreement_is_flagged_for_greedy_completions_only():
    """A sampled completion leaves the target's argmax by design (the demo's T 0.7 set: 54.7%), so its agreement is
    no evidence of a foreign cache: no warning there; a greedy one below 95% is still flagged."""
    greedy = metrics_dict("step-1000", "gsm8k")
    greedy["diagnostics"]["argmax_agreement"] = 0.547
    sampled = {
        **greedy,
        "dataset": "humaneval",
        "sampling": [{"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0}],
    }
    warnings = diagnostics_section.evaluation_warnings(
        [metrics_files.Evaluation(Path("g.json"), greedy), metrics_files.Evaluation(Path("s.json"), sampled)]
    )
    low = [w for w in warnings if "Low argmax agreement" in w]
    assert len(low) == 1 and "step-1000 on gsm8k" in low[0]
    assert not diagnostics_section.agreement_is_low(sampled) and diagnostics_section.agreement_is_low(greedy)
