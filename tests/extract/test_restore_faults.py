"""A server that dies as it comes back after an extraction (issue 32): the real extract stage on a real tiny
target, a real managed server process that the test kills with SIGKILL the moment the extraction relaunches it.

The extraction must survive it: its cache is published and kept in `<out>.kept/` before the restore, the
job does not fail (so Snakemake does not delete the cache), the restore failure is reported with what is on
disk and the command that retries it, and a rerun after the cache was removed anyway (a job killed during
the restore) copies the kept states without running the target.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from dflash_eval import cli
from dflash_eval.cache.reuse import kept_dir
from dflash_eval.cache.store import HiddenCache
from dflash_eval.extract import stage as extract_stage
from dflash_eval.server.control import ServerController
from tests.support import servers as hs
from tests.support.extract_runs import (
    Counting,
    assert_same_states,
    cache_states,
    extract_settings,
    tiny_records,
    write_records,
)
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4, 12, 3]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


def _entries(log_dir):
    path = log_dir / "transitions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _kill_the_relaunch(log_dir, killed: list) -> None:
    """Watch transitions.jsonl; once the extraction ended well and the server was relaunched, SIGKILL it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        entries = _entries(log_dir)
        ends = [i for i, e in enumerate(entries) if e["event"] == "extraction_end" and e["ok"]]
        launches = [e for e in entries[ends[0] :] if e["event"] == "launched"] if ends else []
        if launches:
            os.kill(launches[0]["pid"], signal.SIGKILL)
            killed.append(launches[0]["pid"])
            return
        time.sleep(0.01)


def test_a_server_killed_as_it_comes_back_costs_the_extraction_nothing(target_dir, tmp_path, monkeypatch, caplog):
    log_dir = tmp_path / "logs"
    server = hs.tiny_helper_settings(log_dir)
    server["command"] = "sleep 1; " + server["command"]  # the relaunch takes a second: SIGKILL lands in it
    ctl = ServerController(server)
    try:
        ctl.ensure_up()
        completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
        out = tmp_path / "hidden"
        killed: list[int] = []
        watcher = threading.Thread(target=_kill_the_relaunch, args=(log_dir, killed))
        watcher.start()
        counter = Counting(monkeypatch)
        with caplog.at_level("INFO"):
            path = extract_stage.extract(extract_settings(target_dir, server=server), completions, out)
        watcher.join()
        assert killed and counter.calls == len(LENGTHS)

        # the extraction stands: published, complete, kept
        assert path == out and len(HiddenCache(out).samples) == len(LENGTHS)
        assert all((kept_dir(out) / f.name).samefile(f) for f in out.iterdir())
        # the restore failure is reported as what it is, and what it says is on disk
        error = next(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        assert "outputs are complete" in error and "did not come back" in error
        assert "exited before it became healthy" in error and str(log_dir / "server.log") in error
        assert "dflash-eval server up" in error and str(log_dir / "outage.json") in error
        record = json.loads((log_dir / "outage.json").read_text())
        assert record["holders"] == [] and record["was_up"] and record["restore_error"]
        events = [e["event"] for e in _entries(log_dir)]
        assert events[-1] == "restore_failed" and "resume" not in events[events.index("extraction_end") :]
        assert not ctl.is_healthy()

        # a job killed during the restore would have lost `out` to Snakemake: the rerun copies, computes nothing
        before = cache_states(out)
        shutil.rmtree(out)
        counter = Counting(monkeypatch)
        monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("target loaded"))
        extract_stage.extract(extract_settings(target_dir, server=server), completions, out)
        assert counter.calls == 0
        assert_same_states(cache_states(out), before)

        # the restore is retried by `server up` (or the next fetch or extraction)
        assert cli.main(["server", "up", "--settings", json.dumps(server)]) == 0
        assert ctl.is_healthy() and not (log_dir / "outage.json").exists()
        assert [e["event"] for e in _entries(log_dir)][-1] == "resume"
    finally:
        ServerController({**server, "keep_running": False}).stop_if_launched()
