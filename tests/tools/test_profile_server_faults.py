"""`kill -9` of a real `dflash-eval profile-server` while its simulated-acceptance variant (SGLANG_SIMULATE_ACC_LEN=4,
the demo server) serves: the variant is on the checkout's one server record (server.pid, marked as a variant, with
its launcher), so every cleanup path finds it and says what it is, and none takes it for the configured server:
`server status` names it, and the end-of-run hook (`server finish`), the next run's start (reclaim, what the
Snakefile runs when it loads) and the next fetch (ensure_up) each stop it; the fetch then serves from the configured
server, relaunched. Nothing of the variant is left running after any of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_eval.config import stage_settings
from dflash_eval.server.control import ServerController
from tests.support import servers as hs
from tests.support.demo_server import demo_server
from tests.support.server_control import entries

pytestmark = pytest.mark.slow  # three demo-server launches per case on the 2-core machine


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_eval.cli", *args], capture_output=True, text=True, timeout=300)


def _killed_in_the_variant(tmp_path: Path) -> tuple[dict, dict]:
    """The configured server up, then profile-server SIGKILLed once its acc-len-4 variant is healthy; (the server
    settings, the variant's record)."""
    server, _target, _drafter = demo_server(tmp_path, extra="--enable-metrics")
    ctl = ServerController(server)
    ctl.ensure_up()
    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"id": f"s{i}", "prompt_token_ids": [5 + i, 6, 7]}) + "\n" for i in range(2))
    )
    settings = stage_settings(
        "profile_server",
        {"server": server, "acceptance_lengths": [4], "requests": 2, "max_new_tokens": 9, "command_no_spec": None},
    )
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_eval.cli",
            "profile-server",
            "--settings",
            json.dumps(settings),
            "--completions",
            str(tmp_path / "c.jsonl"),
            "--out",
            str(tmp_path / "profile.json"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    try:
        while True:
            events = entries(server["log_dir"])
            variant = [i for i, e in enumerate(events) if e.get("variant") == "acc-len-4" and e["event"] == "launched"]
            if variant and "healthy" in [e["event"] for e in events[variant[0] :]]:
                break
            assert job.poll() is None and time.monotonic() < deadline, "the variant never became healthy"
            time.sleep(0.05)
        job.send_signal(signal.SIGKILL)  # its `finally` never runs
        job.wait()
    finally:
        if job.poll() is None:
            job.kill()
    record = json.loads((Path(server["log_dir"]) / "server.pid").read_text())
    assert record["variant"] == "acc-len-4" and record["env"] == {"SGLANG_SIMULATE_ACC_LEN": "4"}
    assert record["launcher"]["pid"] == job.pid and ctl.is_healthy()  # the fake-acceptance server is running
    return server, record


@pytest.mark.parametrize("cleanup", ["finish", "next-run-start", "fetch"])
def test_a_killed_profile_server_leaves_no_variant_behind(tmp_path, cleanup):
    server, record = _killed_in_the_variant(tmp_path)
    ctl = ServerController(server)
    try:
        status = _cli("server", "status", "--settings", json.dumps(server))
        launch_facts = json.loads(status.stdout)["launch"]
        assert launch_facts["variant"] == "acc-len-4" and launch_facts["launcher"]["alive"] is False

        if cleanup == "finish":  # Snakemake's onerror after the job's SIGKILL
            done = _cli("server", "finish", "--settings", json.dumps(server))
            assert done.returncode == 0, done.stderr
            assert not ctl.is_healthy()
        elif cleanup == "next-run-start":
            line = ctl.reclaim()
            assert line is not None and "profile-server's variant acc-len-4" in line, line
            assert "SGLANG_SIMULATE_ACC_LEN=4: a simulated-acceptance server, not the configured one" in line
            assert f"launched by profile-server pid {record['launcher']['pid']} (gone)" in line
            assert "stopped that server with its process group" in line
        else:  # the next fetch's ensure_up: the variant is stopped, the configured server launched and used
            ctl.ensure_up()
            assert ctl.is_healthy()
            now = json.loads((Path(server["log_dir"]) / "server.pid").read_text())
            assert now["variant"] is None and now["pgid"] != record["pgid"]
        stops = [e for e in entries(server["log_dir"]) if e["event"] == "stop_requested"]
        assert stops[-1]["pid"] == record["pid"] and stops[-1]["variant"] == "acc-len-4"
        assert hs.group_members(record["pgid"]) == []  # nothing of the variant is left
        assert not (Path(server["log_dir"]) / "outage.json").exists() or cleanup == "next-run-start"
    finally:
        ServerController({**server, "keep_running": False}).finish()
        assert hs.group_members(record["pgid"]) == []
    assert os.path.exists(Path(server["log_dir"]) / "profile" / "acc-len-4" / "server.log")


def test_a_variant_is_never_taken_for_the_configured_server(tmp_path):
    """While a variant is on record, a fetch's quick path (server healthy, no outage) refuses it with what it is."""
    server, record = _killed_in_the_variant(tmp_path)
    ctl = ServerController(server)
    try:
        (Path(server["log_dir"]) / "outage.json").unlink()  # as if the end-of-run hook forgot the outage only
        from dflash_eval.server.kinds import ServerError

        with pytest.raises(ServerError) as error:
            ctl.server.check_ours()
        text = str(error.value)
        assert "profile-server's variant acc-len-4" in text and "not the configured server" in text
        assert "export SGLANG_SIMULATE_ACC_LEN=4; " in text  # the whole command, its switch included
    finally:
        ctl.finish()
    assert hs.group_members(record["pgid"]) == []
