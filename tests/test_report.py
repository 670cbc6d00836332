"""The report stage: CSV numbers equal the metrics, the markdown is complete and loud, plots render."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from dflash_eval import cli, report
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json

SETTINGS = {
    "drafters": {"step-1000": {"step": 1000, "layer_ids": [1, 3]},
                 "step-2000": {"step": 1999, "layer_ids": [1, 3]}},   # checkpoint says 2000: that wins
    "datasets": ["gsm8k", "humaneval"],
    "reference": "step-1000",
}
# (drafter, dataset) -> tau z-lab mean, token-weighted, CI, CI token-weighted
TAUS = {
    ("step-1000", "gsm8k"): (4.1, 4.3, [3.9, 4.3], [4.0, 4.6]),
    ("step-1000", "humaneval"): (3.9, 4.0, [3.7, 4.1], [3.8, 4.2]),
    ("step-2000", "gsm8k"): (5.25, 5.5, [5.0, 5.5], [5.2, 5.8]),
    ("step-2000", "humaneval"): (3.5, 3.6, [3.2, 3.8], [3.3, 3.9]),
}
MISMATCH = ("step-2000", "humaneval")


def metrics_dict(drafter: str, dataset: str) -> dict:
    """A metrics.json as `dflash_eval.evaluate.run_evaluation` builds it."""
    tau, tau_tw, ci, ci_tw = TAUS[(drafter, dataset)]
    mismatch = (drafter, dataset) == MISMATCH
    return {
        "drafter": drafter, "dataset": dataset,
        "checkpoint": {"path": f"/ckpt/{drafter}", "layout": "dflash", "sha256": "ab" * 32,
                       "global_step": 2000 if drafter == "step-2000" else None, "epoch": None,
                       "step": SETTINGS["drafters"][drafter]["step"]},
        "block_size": 4, "layer_ids": [1, 3],
        "cache": {"dir": f"results/hidden/{dataset}/L1-3", "backend": "torch" if mismatch else "fla",
                  "trained_with": "fla", "backend_mismatch_allowed": mismatch, "target_config_hash": "cd" * 32},
        "stop_token_ids": [2], "device": "cpu", "dtype": "float32",
        "chain": {"tau_mean_of_samples": tau, "tau_token_weighted": tau_tw, "samples": 10, "steps": 100,
                  "tokens": int(tau_tw * 100),
                  "ci95": {"tau_mean_of_samples": ci, "tau_token_weighted": ci_tw},
                  "acceptance_by_position": [0.9, 0.7, 0.5], "histogram": {"1": 10, "2": 20, "3": 30, "4": 40}},
        "diagnostics": {"argmax_agreement": 0.9975, "tokens_seen": 400,
                        "samples_skipped": [{"id": "7", "why": "not in the completions file"}] if mismatch else []},
    }


# per-sample acceptance lengths behind the paired verdicts: +1 on every gsm8k sample (better);
# on humaneval half the samples gain 1 and half lose 1 (no clear difference)
SAMPLE_STEPS = {
    ("step-1000", "gsm8k"): {str(i): [4, 4] for i in range(10)},
    ("step-2000", "gsm8k"): {str(i): [5, 5] for i in range(10)},
    ("step-1000", "humaneval"): {str(i): [4] for i in range(10)},
    ("step-2000", "humaneval"): {str(i): [3 if i % 2 else 5] for i in range(10)},
}


def write_metrics(root: Path) -> list[Path]:
    paths = []
    for drafter, dataset in TAUS:
        path = root / "eval" / drafter / dataset / "metrics.json"
        atomic_write_json(path, metrics_dict(drafter, dataset))
        rows = [{"id": i, "method": "chain-B4", "acceptance_lengths": " ".join(map(str, steps))}
                for i, steps in SAMPLE_STEPS[(drafter, dataset)].items()]
        pd.DataFrame(rows).to_csv(path.with_name("samples.csv"), index=False)
        paths.append(path)
    return paths


def test_paired_verdicts_against_the_reference(out):
    table = pd.read_csv(out / "summary.csv", keep_default_na=False)
    verdicts = {(r.drafter, r.dataset): r.verdict for r in table.itertuples()}
    assert verdicts[("step-2000", "gsm8k")] == "better"
    assert verdicts[("step-2000", "humaneval")] == "no clear difference"
    assert verdicts[("step-1000", "gsm8k")] == ""  # the reference itself
    row = table[(table.drafter == "step-2000") & (table.dataset == "gsm8k")].iloc[0]
    assert [float(row[c]) for c in ("diff_vs_reference", "diff_ci_low", "diff_ci_high")] == [1.0, 1.0, 1.0]
    markdown = (out / "summary.md").read_text()
    assert "## Verdicts against the reference (step-1000)" in markdown and "**better**" in markdown


def report_args(root: Path, metrics: list[Path], settings: dict = SETTINGS) -> argparse.Namespace:
    return argparse.Namespace(settings=json.dumps(settings), config=None, metrics=[str(p) for p in metrics],
                              csv=str(root / "summary.csv"), md=str(root / "summary.md"),
                              plot=str(root / "plots" / "tau.png"), plot_dir=None)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    assert report.run(report_args(root, write_metrics(root))) == 0
    return root


def test_csv_numbers_equal_the_metrics(out):
    table = pd.read_csv(out / "summary.csv")
    assert list(table.columns) == report.COLUMNS
    assert list(zip(table.drafter, table.dataset)) == list(TAUS)       # config order
    for row in table.itertuples():
        metrics = metrics_dict(row.drafter, row.dataset)
        chain = metrics["chain"]
        assert row.method == "chain-B4" and row.block_size == 4
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
        reference = TAUS[("step-1000", row.dataset)][0]
        assert row.tau_vs_reference == pytest.approx(chain["tau_mean_of_samples"] / reference)


def _table_line(markdown: str, section: str, drafter: str) -> str:
    body = markdown.split(section, 1)[1]
    return next(line for line in body.splitlines() if line.startswith(f"| {drafter}"))


def test_markdown_has_every_drafter_and_the_bold_best(out):
    markdown = (out / "summary.md").read_text()
    main = "## tau, z-lab mean"
    first, second = _table_line(markdown, main, "step-1000"), _table_line(markdown, main, "step-2000")
    assert "step-1000 (reference)" in first and "| 1000 |" in first and "| 2000 |" in second
    assert "**5.25** <sub>[5.00, 5.50]</sub>" in second          # best on gsm8k
    assert "**3.90** <sub>[3.70, 4.10]</sub>" in first           # best on humaneval
    assert "| 4.10 <sub>[3.90, 4.30]</sub>" in first and "3.50 <sub>[3.20, 3.80]</sub> ⚠️" in second
    assert "gsm8k<br>chain-B4 | humaneval<br>chain-B4" in markdown
    assert "**5.50** <sub>[5.20, 5.80]</sub>" in _table_line(markdown, "## tau, token-weighted", "step-2000")
    assert "128.0%" in _table_line(markdown, "relative to the reference", "step-2000")


def test_markdown_flags_the_backend_mismatch_loudly(out):
    markdown = (out / "summary.md").read_text()
    warnings = markdown.split("## ⚠️ Warnings", 1)[1].split("## tau", 1)[0]
    assert "**Backend mismatch**: step-2000 on humaneval" in warnings and "`torch`" in warnings
    diagnostics = markdown.split("## Diagnostics", 1)[1]
    row = next(line for line in diagnostics.splitlines() if line.startswith("| step-2000 | humaneval"))
    assert "**⚠️ YES (allowed)**" in row and "99.75%" in row and "7 (not in the completions file)" in row
    assert "1, 3" in row and "sha256 abababababab" in row
    assert sum("⚠️ YES" in line for line in diagnostics.splitlines()) == 1


@pytest.mark.parametrize("name", ["tau.png", "tau_vs_step.png"])
def test_plots_open_at_the_expected_size_and_are_not_blank(out, name):
    pixels = matplotlib.image.imread(out / "plots" / name)
    assert pixels.shape[:2] == (600, 1200)
    assert pixels[..., :3].var() > 0
    assert not list((out / "plots").glob(".*"))          # no temporary files left behind


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


def test_one_stepped_drafter_makes_no_step_plot_and_cli_runs(tmp_path):
    paths = [p for p in write_metrics(tmp_path) if "step-1000" in str(p)]
    settings = {"drafters": {"step-1000": SETTINGS["drafters"]["step-1000"]}, "datasets": SETTINGS["datasets"],
                "reference": None}
    args = report_args(tmp_path, paths, settings)
    argv = ["report", "--settings", args.settings, "--metrics", *args.metrics, "--csv", args.csv,
            "--md", args.md, "--plot", args.plot]
    assert cli.main(argv) == 0
    assert (tmp_path / "plots" / "tau.png").is_file() and not (tmp_path / "plots" / "tau_vs_step.png").exists()
    assert "relative to the reference" not in (tmp_path / "summary.md").read_text()
    assert cli.main(argv[:4] + [str(tmp_path / "absent.json")] + argv[4:]) == 2


def test_an_empty_evaluation_reports_na_and_warns(tmp_path):
    paths = write_metrics(tmp_path)
    empty = metrics_dict("step-2000", "gsm8k")
    nan = float("nan")
    empty["chain"].update(tau_mean_of_samples=nan, tau_token_weighted=nan, samples=0, steps=0, tokens=0,
                          ci95={"tau_mean_of_samples": [nan, nan], "tau_token_weighted": [nan, nan]})
    empty["diagnostics"]["argmax_agreement"] = None
    atomic_write_json(paths[2], empty)                  # json writes NaN, as evaluate does
    assert report.run(report_args(tmp_path, paths)) == 0
    markdown = (tmp_path / "summary.md").read_text()
    assert "**No samples**: step-2000 on gsm8k" in markdown
    assert "| **4.10** <sub>[3.90, 4.30]</sub>" in _table_line(markdown, "## tau, z-lab mean", "step-1000")
    assert "| n/a |" in _table_line(markdown, "## tau, z-lab mean", "step-2000")
    assert "n/a (no argmax stored)" in markdown
    row = pd.read_csv(tmp_path / "summary.csv").iloc[2]
    assert pd.isna(row.tau_mean_of_samples) and row.samples == 0
