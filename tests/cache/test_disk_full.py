"""A disk that fills during a real extraction (`dflash-eval extract`, a process of its own, writing onto a small
tmpfs in a mount namespace of its own): the message names the path that filled, how much the cache still needs
and that a rerun resumes; nothing already written is lost, and the rerun, once there is room, resumes from the
journaled shards and publishes the same cache a run with room from the start gives. Needs root (mount)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.extract_runs import extract_settings, tiny_records, write_records
from tests.support.tiny import tiny_target

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare, to mount a small tmpfs in a namespace of its own",
)

SCRIPT = """
set -u
mount -t tmpfs -o size=64k tmpfs "$DISK" || exit 90
$EXTRACT > "$LOGS/first.out" 2>&1; echo $? > "$LOGS/first.rc"
ls "$DISK" > "$LOGS/after-first.ls"
cp -r "$DISK"/cache.partial "$LOGS/kept" 2>/dev/null
mount -o remount,size=16m "$DISK"
$EXTRACT > "$LOGS/second.out" 2>&1; echo $? > "$LOGS/second.rc"
cp -r "$DISK"/cache "$LOGS/published"
"""


def _extract(settings, completions, out) -> str:
    """The by-hand command line (--settings takes a file of JSON as well)."""
    return f"{sys.executable} -m dflash_eval.cli extract --settings {settings} --completions {completions} --out {out}"


def test_a_full_disk_mid_extraction_says_where_and_what_it_needs_and_the_rerun_resumes(tmp_path):
    target = tmp_path / "target"
    tiny_target().save_pretrained(target)
    completions = write_records(tmp_path / "toy.jsonl", tiny_records([24] * 40))
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(extract_settings(target)))
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir()
    logs.mkdir()
    env = {
        **os.environ,
        "DISK": str(disk),
        "LOGS": str(logs),
        "OMP_NUM_THREADS": "1",
        "EXTRACT": _extract(settings, completions, disk / "cache"),
    }
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode == 90:
        pytest.skip("tmpfs cannot be mounted here")
    first = (logs / "first.out").read_text()
    assert (logs / "first.rc").read_text().strip() != "0", first
    assert "Traceback" not in first and "Errno 28" not in first.replace("(No space left on device)", ""), first
    said = next(line for line in first.splitlines() if "the disk is full" in line)
    assert f"{disk}/cache.partial/shard_" in said and "(No space left on device)" in said, said
    assert "this cache needs about" in said and "still to write, this one included" in said, said
    assert f"a rerun resumes from the shards already journaled in {disk}/cache.partial" in said, said
    kept = [line for line in (logs / "kept" / "journal.jsonl").read_text().splitlines() if line.strip()]
    assert kept, "the shards written before the disk filled are kept"

    second = (logs / "second.out").read_text()
    assert (logs / "second.rc").read_text().strip() == "0", second
    assert f"{len(kept)} of" in second or "resum" in second.lower(), second  # it said it resumed

    reference = tmp_path / "reference"  # the same extraction with room from the start
    whole = subprocess.run(
        _extract(settings, completions, reference),
        shell=True,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert whole.returncode == 0, whole.stderr
    published = json.loads((logs / "published" / "manifest.json").read_text())
    fresh = json.loads((reference / "manifest.json").read_text())
    assert [s["sha256"] for s in published["shards"]] == [s["sha256"] for s in fresh["shards"]]
    assert published["resumed_shards"] == len(kept)
