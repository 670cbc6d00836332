"""Two workflow runs of one checkout share its managed server (Snakemake's lock lets runs with disjoint targets
through): a run's end-of-run hook (`dflash-eval server finish`) stops only a server that it launched or whose
launcher is gone, never one that another live run launched or fetches from; and a run whose server was stopped by
someone else is told who. Real processes throughout: the runs are live processes whose identity the jobs inherit
(DFLASH_EVAL_RUN, as the Snakefile sets it), the jobs are the real CLI, the server a real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_eval.server.processes import process_start_ticks
from dflash_eval.server.runs import RUN_ENV
from tests.support import servers as hs
from tests.support.server_control import entries, make


class Run:
    """A live process standing for a workflow run's Snakemake: its jobs carry its identity in DFLASH_EVAL_RUN."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        self.identity = {
            "pid": self.proc.pid,
            "start_ticks": process_start_ticks(self.proc.pid),
            "host": socket.gethostname(),
        }

    def job(self, settings: dict, *action: str) -> subprocess.CompletedProcess:
        """`dflash-eval server ACTION --settings JSON` as a job (or the end-of-run hook) of this run."""
        env = {**os.environ, RUN_ENV: json.dumps(self.identity)}
        return subprocess.run(
            [sys.executable, "-m", "dflash_eval.cli", "server", *action, "--settings", json.dumps(settings)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def end(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait()


@pytest.fixture
def runs():
    made: list[Run] = []
    yield lambda: made.append(Run()) or made[-1]
    for run in made:
        run.end()


def _pgid(settings: dict) -> int:
    return json.loads((Path(settings["log_dir"]) / "server.pid").read_text())["pgid"]


def test_a_run_s_end_leaves_the_server_that_another_live_run_launched(tmp_path, controllers, runs):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    ctl = make(controllers, settings)
    first, second = runs(), runs()
    assert first.job(settings, "up").returncode == 0  # the first run's fetch launches it
    assert second.job(settings, "up").returncode == 0  # the second run's job finds it up and uses it
    pgid = _pgid(settings)
    record = json.loads((tmp_path / "logs" / "server.pid").read_text())
    assert record["owner"]["pid"] == first.proc.pid and [u["pid"] for u in record["users"]] == [second.proc.pid]

    done = second.job(settings, "finish")  # the short run ends while the first one still fetches
    assert done.returncode == 0, done.stderr
    assert ctl.is_healthy() and hs.group_members(pgid), "the second run's end stopped the first run's server"
    assert f"left running: workflow run {first.proc.pid}, still running, launched or uses it" in done.stderr
    assert entries(tmp_path / "logs")[-1]["event"] == "kept"

    done = first.job(settings, "finish")  # the run that launched it ends: nobody else uses it
    assert done.returncode == 0, done.stderr
    assert not ctl.is_healthy() and hs.group_members(pgid) == []
    stop = [e for e in entries(tmp_path / "logs") if e["event"] == "stop_requested"][-1]
    assert stop["by_run"] == first.proc.pid and stop["reason"] == "end of run"


def test_the_launching_run_s_end_leaves_the_server_to_a_live_run_that_uses_it(tmp_path, controllers, runs):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    ctl = make(controllers, settings)
    first, second = runs(), runs()
    assert first.job(settings, "up").returncode == 0
    assert second.job(settings, "up").returncode == 0
    pgid = _pgid(settings)
    done = first.job(settings, "finish")  # the launcher ends first, the other run is mid-fetch
    assert done.returncode == 0 and ctl.is_healthy() and hs.group_members(pgid)
    assert f"workflow run {second.proc.pid}, still running" in done.stderr
    done = second.job(settings, "finish")  # the last run out stops it
    assert done.returncode == 0 and not ctl.is_healthy() and hs.group_members(pgid) == []


def test_a_run_stops_a_server_whose_launching_run_is_gone(tmp_path, controllers, runs):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    ctl = make(controllers, settings)
    first, second = runs(), runs()
    assert first.job(settings, "up").returncode == 0
    pgid = _pgid(settings)
    first.end(signal.SIGKILL)  # gone without its end-of-run hook
    done = second.job(settings, "finish")
    assert done.returncode == 0, done.stderr
    assert not ctl.is_healthy() and hs.group_members(pgid) == []


def test_a_fetch_whose_server_was_stopped_by_another_is_told_who(tmp_path, controllers, runs):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    ctl = make(controllers, settings)
    first = runs()
    assert first.job(settings, "up").returncode == 0
    since = time.time()
    assert ctl.went_down_since(since) == ""
    by_hand = subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", "server", "stop-launched", "--settings", json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert by_hand.returncode == 0 and not ctl.is_healthy()
    stop = [e for e in entries(tmp_path / "logs") if e["event"] == "stop_requested"][-1]
    said = ctl.went_down_since(since)
    assert f"stopped meanwhile, at {stop['time']}, by pid {stop['by_pid']}" in said, said
    assert "`cli.py server stop-launched --settings JSON`: stop-launched; see" in said  # its command, the reason


def test_a_real_fetch_whose_server_another_process_stopped_says_who(tmp_path, controllers):
    """The real `dflash-eval fetch` from a managed server (the fake OpenAI server, each answer 0.3 s late); another
    process stops the server mid-fetch (`dflash-eval server stop-launched`). The fetch fails saying who stopped it
    (before: a bare "Connection error" after the retries), and the records it already had are kept."""
    from dflash_eval.testing import fixtures
    from tests.support.fake_fetch import FAKE, served

    tokenizer = tmp_path / "tok"
    fixtures.build_tokenizer(tokenizer)
    port = fixtures.free_port()
    log = tmp_path / "requests.jsonl"
    server = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "health_timeout_s": 30,
        "stop_grace_s": 5,
        "log_dir": str(tmp_path / "logs"),
        "command": f"exec {sys.executable} {FAKE} --port {port} --tokenizer "
        f"{tokenizer} --model {tokenizer} --delay-s 0.3 --request-log {log}",
    }
    make(controllers, server)
    settings = {
        "dataset": "t",
        "prompts": str(fixtures.write_prompts(tmp_path / "p.jsonl", 30)),
        "server": server,
        "tokenizer": str(tokenizer),
        "max_tokens": 8,
        "concurrency": 1,
        "timeout_s": 10.0,
        "retries": 1,
        "backoff_s": 0.05,
    }
    out = tmp_path / "t.jsonl"
    fetch = subprocess.Popen(
        [sys.executable, "-m", "dflash_eval.cli", "fetch", "--settings", json.dumps(settings), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(served(log)) < 3:
            assert fetch.poll() is None and time.monotonic() < deadline, fetch.communicate()[1][-3000:]
            time.sleep(0.05)
        stop = subprocess.run(
            [sys.executable, "-m", "dflash_eval.cli", "server", "stop-launched", "--settings", json.dumps(server)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0, stop.stderr
        _, err = fetch.communicate(timeout=120)
    finally:
        if fetch.poll() is None:
            fetch.kill()
    assert fetch.returncode != 0 and "Traceback" not in err, err[-3000:]
    said = next(line for line in err.splitlines() if "stopped meanwhile" in line)
    entry = [e for e in entries(tmp_path / "logs") if e["event"] == "stop_requested"][-1]
    assert f"by pid {entry['by_pid']} (`cli.py server stop-launched --settings JSON`: stop-launched" in said, said
    kept = (tmp_path / "t.jsonl.partial").read_text().splitlines()
    assert len(kept) >= 3 and not out.exists()  # what was fetched is kept for the rerun
