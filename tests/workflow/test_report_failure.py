"""A failed report job keeps the last good report, and its error names the cause (real snakemake runs).

Snakemake deletes a job's outputs before it runs and a failed job's outputs after; the report's are
declared update(), so Snakemake keeps them while the job runs and puts them back when it fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from dflash_eval.report.plots import PLOTS
from dflash_eval.testing import workflow as harness
from tests.support.checkout import copy_workflow
from tests.support.report_project import report_project, report_snakemake

REPORT_FILES = ("summary.csv", "summary.md", "trust.json", *(f"plots/{plot.file}" for plot in PLOTS.values()))


def report_files(results: Path) -> dict[str, bytes]:
    return {name: (results / name).read_bytes() for name in REPORT_FILES}


def test_a_failing_report_command_keeps_the_last_report_and_names_the_file(tmp_path):
    results = report_project(tmp_path)
    first = report_snakemake(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    good = report_files(results)
    broken = results / "eval" / "step-2000" / "gsm8k" / "metrics.json"
    broken.write_text(broken.read_text()[:100])  # a half-written metrics file: the report refuses it

    run = report_snakemake(tmp_path, "--show-failed-logs")
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"{broken.relative_to(tmp_path)}: not valid JSON" in text, text[-3000:]
    assert "latency" not in text
    assert report_files(results) == good  # every file, byte for byte


def test_an_evaluation_that_cannot_be_made_stops_the_run_before_the_report_is_touched(tmp_path):
    """The issue's case: a new drafter whose directory does not exist, added after a good report."""
    workflow, root = copy_workflow(tmp_path / "workflow"), tmp_path / "project"
    config = harness.tiny_project(root, big_checkpoint=False)
    harness.check(harness.snakemake(workflow, root))
    good = report_files(root / "results")
    config["drafters"]["new"] = {"path": "ckpt/missing", "layer_ids": [1, 2], "trained_with": "torch"}
    harness.save_config(root, config)

    for args in (("--dry-run",), ()):
        run = harness.snakemake(workflow, root, *args)
        text = run.stdout + run.stderr
        assert run.returncode != 0, text[-3000:]
        assert "ckpt/missing" in text and "latency" not in text, text[-3000:]
        assert report_files(root / "results") == good
    calls = (root / "calls.log").read_text().splitlines()
    assert [call for call in calls if call.startswith("report ")] == ["report results/summary.csv"]  # ran once


def test_a_report_job_that_failed_after_a_change_is_rebuilt_by_the_next_run(tmp_path, monkeypatch):
    """Snakemake records a failed job's params for the update() outputs it puts back (snakemake#3808): without
    the marker, the run after a failed report says "Nothing to be done" and the kept report stays stale."""
    root = tmp_path / "project"
    root.mkdir()
    results = report_project(root)
    harness.check(report_snakemake(root))
    good = report_files(results)
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["report"]["online_tolerance"] = config["report"]["online_tolerance"] * 2  # a params change
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    broken_cli = tmp_path / "bin"
    broken_cli.mkdir()
    (broken_cli / "dflash-eval").write_text("#!/bin/sh\necho 'report code broke' >&2\nexit 3\n")
    (broken_cli / "dflash-eval").chmod(0o755)
    real_path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{broken_cli}{os.pathsep}{real_path}")

    failed = report_snakemake(root)
    assert failed.returncode != 0, failed.stdout[-2000:]
    assert report_files(results) == good  # the last report, kept

    monkeypatch.setenv("PATH", real_path)
    dry = report_snakemake(root, "--dry-run")
    assert "Nothing to be done" not in dry.stdout + dry.stderr, dry.stdout[-2000:]
    assert "the last report job failed" in dry.stdout
    assert not (results / ".report_failed").exists()  # read once: the kept files' dates say it now
    rebuilt = report_snakemake(root)
    harness.check(rebuilt)
    assert "rule report" in rebuilt.stdout + rebuilt.stderr
    assert not (results / ".report_failed").exists()
    again = report_snakemake(root, "--dry-run")
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-2000:]
