"""The report stage end to end: the command line, and what a failure leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_eval import cli
from dflash_eval.report import plots
from dflash_eval.report import stage as report
from tests.support.report_inputs import SETTINGS, report_args, write_metrics


def test_one_stepped_drafter_makes_no_step_plot_and_cli_runs(tmp_path):
    paths = [p for p in write_metrics(tmp_path) if "step-1000" in str(p)]
    settings = {
        "drafters": {"step-1000": SETTINGS["drafters"]["step-1000"]},
        "datasets": SETTINGS["datasets"],
        "reference": None,
    }
    args = report_args(tmp_path, paths, settings)
    argv = [
        "report",
        "--settings",
        args.settings,
        "--metrics",
        *args.metrics,
        "--csv",
        args.csv,
        "--md",
        args.md,
        "--plot-dir",
        args.plot_dir,
    ]
    assert cli.main(argv) == 0
    assert all(
        (tmp_path / "plots" / name).is_file() for name in (plot.file for plot in plots.PLOTS.values())
    )  # the step plot says why empty
    assert "relative to the reference" not in (tmp_path / "summary.md").read_text()
    assert cli.main(argv[:4] + [str(tmp_path / "absent.json")] + argv[4:]) == 2


def _report_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parent.name in (root.name, "plots") and p.suffix in (".csv", ".md", ".json", ".png")
    }


def test_a_registered_plot_is_drawn_and_written(tmp_path, monkeypatch):
    """Adding a plot is one registry entry: the stage draws it and writes it beside the others."""
    extra = plots.Plot("extra.png", plots.PLOTS["tau"].draw, "extra.rst")
    monkeypatch.setitem(plots.PLOTS, "extra", extra)
    assert report.run(report_args(tmp_path, write_metrics(tmp_path))) == 0
    assert (tmp_path / "plots" / "extra.png").read_bytes() == (tmp_path / "plots" / "tau.png").read_bytes()


def test_a_failure_while_rendering_leaves_the_last_report_as_it_was(tmp_path, monkeypatch):
    """Every file is rendered before the first is written: a failing plot changes nothing on disk."""
    paths = write_metrics(tmp_path)
    assert report.run(report_args(tmp_path, paths)) == 0
    good = _report_files(tmp_path)
    assert len(good) == 3 + len(plots.PLOTS)

    def broken(data: plots.PlotData) -> None:
        raise RuntimeError("drawing failed")

    monkeypatch.setitem(plots.PLOTS, "broken", plots.Plot("broken.png", broken, "broken.rst"))
    with pytest.raises(RuntimeError, match="drawing failed"):
        report.run(report_args(tmp_path, paths, {**SETTINGS, "reference": None}))  # another summary.md
    assert _report_files(tmp_path) == good
    assert not list((tmp_path / "plots").glob(".*")) and not list(tmp_path.glob(".*"))  # no temporary files
