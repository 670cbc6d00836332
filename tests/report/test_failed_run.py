"""The kept report after a failed report job is dated before its inputs, once."""

from __future__ import annotations

import os

from dflash_eval.report.failed_run import date_kept_report_before_inputs


def test_without_a_marker_nothing_is_dated(tmp_path):
    report = tmp_path / "summary.csv"
    report.write_text("x")
    stamp = report.stat().st_mtime
    assert date_kept_report_before_inputs(tmp_path / ".report_failed", [report], []) == []
    assert report.stat().st_mtime == stamp


def test_a_marker_dates_the_kept_outputs_before_the_oldest_input_and_goes(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    for path, when in ((old, 1_000_000), (new, 2_000_000)):
        path.write_text("{}")
        os.utime(path, (when, when))
    report, marker = tmp_path / "summary.csv", tmp_path / ".report_failed"
    report.write_text("kept")
    marker.write_text("2026-12-02T00:00:00Z\n")
    missing = tmp_path / "plots" / "none.png"

    dated = date_kept_report_before_inputs(marker, [report, missing], [new, old, tmp_path / "absent.json"])

    assert dated == [str(report)]
    assert report.stat().st_mtime == 999_999
    assert report.read_text() == "kept"
    assert not marker.exists()
    assert date_kept_report_before_inputs(marker, [report], [old]) == []  # once


def test_with_no_input_on_disk_the_kept_outputs_go_to_the_epoch(tmp_path):
    report, marker = tmp_path / "summary.csv", tmp_path / ".report_failed"
    report.write_text("kept")
    marker.touch()
    assert date_kept_report_before_inputs(marker, [report], [tmp_path / "absent.json"]) == [str(report)]
    assert report.stat().st_mtime == 0
