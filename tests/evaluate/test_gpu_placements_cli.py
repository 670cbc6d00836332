"""`dflash-eval gpu-placements` on odd input, as a user runs it (the real console entry in a subprocess): a record
without `gpu`, string timestamps, `--json` into a missing folder, a folder without records. Each ends with one line
naming the file and the fix, never a traceback; the records themselves are left as they were."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", "gpu-placements", *args], capture_output=True, text=True, timeout=120
    )


def _write(folder: Path, name: str, record: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.gpu.json"
    path.write_text(json.dumps(record))
    return path


GOOD = {"device": "cuda:0", "gpu": "GPU-a", "host": "h", "start": 10.0, "end": 20.0}


@pytest.mark.parametrize(
    "record, said",
    [
        ({k: v for k, v in GOOD.items() if k != "gpu"}, "a cuda:0 claim without 'gpu', the GPU it held"),
        ({**GOOD, "start": "2026-12-03T10:00:00"}, "'start' is '2026-12-03T10:00:00', not seconds since the epoch"),
        ({**GOOD, "end": "later"}, "'end' is 'later', not seconds since the epoch"),
        ([1, 2], "a JSON list, not an object"),
    ],
    ids=["no-gpu", "string-start", "string-end", "not-an-object"],
)
def test_an_odd_record_is_named_with_the_fix(tmp_path, record, said):
    path = _write(tmp_path / "records", "odd", record)
    before = path.read_bytes()
    done = _run(str(tmp_path / "records"))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"{path}: not a GPU claim record ({said}); delete it and rerun its job" in done.stderr, done.stderr
    assert path.read_bytes() == before


def test_a_folder_without_records_is_not_a_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _run(str(tmp_path / "empty"), "--expect-peak", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"no GPU claim records (*.gpu.json) in {tmp_path / 'empty'}: nothing to check" in done.stderr


def test_json_into_a_missing_folder_is_written(tmp_path):
    _write(tmp_path / "records", "a", GOOD)
    out = tmp_path / "not" / "yet" / "check.json"
    done = _run(str(tmp_path / "records"), "--expect-peak", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["peak"] == 1
