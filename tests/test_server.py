"""ServerController and server_paused against real processes: a tiny stdlib HTTP server (fast) for the
process mechanics, and a real `transformers serve` of a tiny Qwen3.5 target for the pause round trip."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers_server as hs
import pytest

from dflash_eval import cli
from dflash_eval.errors import DflashEvalError
from dflash_eval.server import ServerController, ServerError, port_open, server_paused


def transitions(log_dir: Path | str) -> list[str]:
    path = Path(log_dir) / "transitions.jsonl"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def controllers():
    """Controllers made by a test; whatever they launched is stopped afterwards."""
    made: list[ServerController] = []
    yield made
    for ctl in made:
        ServerController(ctl.settings).stop_if_launched()


def make(controllers: list, settings: dict) -> ServerController:
    ctl = ServerController(settings)
    controllers.append(ctl)
    return ctl


# ----- tiny HTTP server: process mechanics -----


def test_managed_up_and_down(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    assert not ctl.is_healthy()
    ctl.ensure_up()
    assert ctl.is_healthy()
    pid = ctl.launched_pid()
    assert pid is not None and os.getpgid(pid) == pid  # its own process group
    assert "launching" in (tmp_path / "logs" / "server.log").read_text()
    ctl.ensure_up()  # already up: a no-op
    ctl.take_down()
    assert not ctl.is_healthy() and not port_open(ctl.base_url)
    assert not (tmp_path / "logs" / "server.pid").exists()
    assert transitions(tmp_path / "logs") == ["start_requested", "launched", "healthy", "stop_requested", "down"]
    entry = json.loads((tmp_path / "logs" / "transitions.jsonl").read_text().splitlines()[0])
    assert {"time", "unix", "event", "kind", "base_url"} <= set(entry)


def test_sigkill_after_grace(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", "--ignore-sigterm", stop_grace_s=1.0))
    ctl.ensure_up()
    pid = ctl.launched_pid()
    start = time.monotonic()
    ctl.take_down()
    assert time.monotonic() - start >= 1.0
    assert not port_open(ctl.base_url)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_port_in_use_by_unhealthy_server(tmp_path, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    port = settings["base_url"].rsplit(":", 1)[1]
    squatter = subprocess.Popen([sys.executable, str(hs.HELPER_SCRIPT), "--port", port, "--unhealthy"])
    try:
        deadline = time.monotonic() + 30
        while not port_open(settings["base_url"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ServerError, match="in use by something that is not a healthy server"):
            make(controllers, settings).ensure_up()
    finally:
        squatter.kill()
        squatter.wait()


def test_refuses_to_stop_a_server_it_did_not_launch(tmp_path, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    port = settings["base_url"].rsplit(":", 1)[1]
    other = subprocess.Popen([sys.executable, str(hs.HELPER_SCRIPT), "--port", port])
    try:
        ctl = make(controllers, settings)
        deadline = time.monotonic() + 30
        while not ctl.is_healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        ctl.ensure_up()  # healthy already: nothing launched
        assert ctl.launched_pid() is None
        with pytest.raises(ServerError, match="not launched by dflash-eval"):
            ctl.take_down()
    finally:
        other.kill()
        other.wait()


def test_launch_failure_shows_the_log(tmp_path, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    settings["command"] = "echo 'boom: no such model'; exit 3"
    with pytest.raises(ServerError, match="boom: no such model"):
        make(controllers, settings).ensure_up()


def test_paused_takes_down_and_restores(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    with server_paused(ctl.settings) as paused:
        assert paused.base_url == ctl.base_url
        assert not ctl.is_healthy() and not port_open(ctl.base_url)
    assert ctl.is_healthy()
    assert transitions(tmp_path / "logs")[3:] == [
        "pause", "stop_requested", "down", "start_requested", "launched", "healthy", "resume"
    ]


def test_paused_restores_after_an_exception(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    with pytest.raises(KeyboardInterrupt), server_paused(ctl.settings):
        raise KeyboardInterrupt  # Ctrl-C
    assert ctl.is_healthy()


def test_paused_waits_for_the_host_lock(tmp_path, controllers):
    """A second pauser blocks on the lock until the first has brought the server back."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    code = (
        "import json, sys\n"
        "from dflash_eval.server import ServerController, server_paused\n"
        "s = json.loads(sys.argv[1])\n"
        "with server_paused(s):\n"
        "    pass\n"
        "print('second done', flush=True)\n"
    )
    with server_paused(ctl.settings):
        other = subprocess.Popen([sys.executable, "-c", code, json.dumps(ctl.settings)], stdout=subprocess.PIPE, text=True)
        time.sleep(3.0)
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0 and "second done" in out
    assert ctl.is_healthy()
    lines = [json.loads(line) for line in (tmp_path / "logs" / "transitions.jsonl").read_text().splitlines()]
    pausers = [e["by_pid"] for e in lines if e["event"] == "pause"]
    assert pausers[0] == os.getpid() and pausers[1] == other.pid
    first_resume = next(i for i, e in enumerate(lines) if e["event"] == "resume")
    assert all(i > first_resume for i, e in enumerate(lines) if e["by_pid"] == other.pid)


def test_paused_down_server_stays_down(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    with server_paused(ctl.settings):
        assert not ctl.is_healthy()
    assert not ctl.is_healthy() and not port_open(ctl.base_url)
    assert ctl.launched_pid() is None
    assert transitions(tmp_path / "logs") == ["pause", "resume"]


def test_paused_restores_after_sigterm(tmp_path, controllers):
    """Snakemake cancels a job with SIGTERM: the server must come back all the same."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    code = (
        "import json, sys, time\n"
        "from dflash_eval.server import server_paused\n"
        "with server_paused(json.loads(sys.argv[1])):\n"
        "    print('inside', flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(ctl.settings)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "inside"
    assert not ctl.is_healthy()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Terminated" in err
    assert ctl.is_healthy()
    assert transitions(tmp_path / "logs")[-3:] == ["launched", "healthy", "resume"]


def test_external_kind(tmp_path):
    pidfile = tmp_path / "ext.pid"
    port = hs.free_port()
    settings = {
        "kind": "external",
        "base_url": f"http://127.0.0.1:{port}",
        "start_command": f"{sys.executable} {hs.HELPER_SCRIPT} --port {port} >/dev/null 2>&1 & echo $! > {pidfile}",
        "stop_command": f"kill $(cat {pidfile})",
        "health_timeout_s": 30.0,
        "log_dir": str(tmp_path / "logs"),
    }
    ctl = ServerController(settings)
    try:
        ctl.ensure_up()
        with server_paused(settings):
            assert not ctl.is_healthy()
        assert ctl.is_healthy()
    finally:
        if pidfile.exists():
            subprocess.run(["kill", pidfile.read_text().strip()], check=False)


def test_release_kind(tmp_path):
    state = tmp_path / "state.txt"
    settings = hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state))
    proc = subprocess.Popen(settings["command"], shell=True)
    release = {"kind": "release", "base_url": settings["base_url"], "log_dir": settings["log_dir"], "health_timeout_s": 30.0}
    try:
        ctl = ServerController(release)
        ctl.ensure_up()  # waits for health; sends no resume: nothing was released
        with server_paused(release):
            assert state.read_text().split() == ["release_memory_occupation"]
        assert state.read_text().split() == ["release_memory_occupation", "resume_memory_occupation"]
        assert ctl.is_healthy()
    finally:
        proc.kill()
        proc.wait()


def test_settings_are_checked():
    with pytest.raises(DflashEvalError, match="needs `command`"):
        ServerController({"kind": "managed"})
    with pytest.raises(DflashEvalError, match="unknown server settings"):
        ServerController({"kind": "release", "port": 1})


def test_cli(tmp_path, capsys, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    make(controllers, settings)
    as_json = json.dumps(settings)
    assert cli.main(["server", "status", "--settings", as_json]) == 3
    assert json.loads(capsys.readouterr().out)["healthy"] is False
    assert cli.main(["server", "up", "--settings", as_json]) == 0
    assert cli.main(["server", "status", "--settings", as_json]) == 0
    assert json.loads(capsys.readouterr().out)["launched_pid"] is not None
    assert cli.main(["server", "stop-launched", "--settings", as_json]) == 0
    assert cli.main(["server", "status", "--settings", as_json]) == 3


# ----- real `transformers serve` -----


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    settings = hs.shared_transformers_server(tmp_path_factory.getbasetemp())
    yield settings
    ServerController(settings).stop_if_launched()


@pytest.mark.slow
def test_paused_real_server_down_inside_and_back_after_an_exception(tiny_server):
    """One pause round trip of `transformers serve`. Slow: each start of it imports torch and transformers
    (50-60 CPU seconds on the 2-core dev machine); the tiny server above covers the same code paths."""
    ctl = ServerController(tiny_server)
    ctl.ensure_up()
    pid = ctl.launched_pid()
    with pytest.raises(RuntimeError, match="extraction failed"), server_paused(tiny_server):
        assert not ctl.is_healthy() and not port_open(ctl.base_url)
        raise RuntimeError("extraction failed")
    assert ctl.is_healthy() and ctl.launched_pid() not in (None, pid)
    events = transitions(tiny_server["log_dir"])
    assert events[-7:] == ["pause", "stop_requested", "down", "start_requested", "launched", "healthy", "resume"]
