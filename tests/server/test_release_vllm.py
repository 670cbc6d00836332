"""The release kind against vLLM 0.34.0's sleep mode: the same faults as SGLang's release (tests/server/
test_control.py), through the same machinery (server.kinds.Release with server.engines' vLLM calls)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_eval.server import engines
from dflash_eval.server.control import ServerController, ServerError, server_paused
from dflash_eval.testing import fixtures
from tests.support.server_control import entries, pauser

HELPER = Path(__file__).with_name("vllm_sleep_server.py")
BUSY_MIB = 80000


def launch(tmp_path: Path, *flags: str, dev_mode: bool = True) -> tuple[subprocess.Popen, dict]:
    port = fixtures.free_port()
    env = f"VLLM_SERVER_DEV_MODE={int(dev_mode)} "
    command = (
        f"{env}exec {sys.executable} {HELPER} --port {port} --state {tmp_path / 'state.txt'} "
        f"--memory-file {tmp_path / 'gpu_mib'} {' '.join(flags)}"
    )
    proc = subprocess.Popen(command, shell=True)
    settings = {
        "kind": "release",
        "base_url": f"http://127.0.0.1:{port}",
        "log_dir": str(tmp_path / "logs"),
        "health_timeout_s": 30.0,
        "release_check_s": 1.0,
        "memory_probe": f"cat {tmp_path / 'gpu_mib'}",
    }
    deadline = time.monotonic() + 30
    while not ServerController(settings).is_healthy():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc, settings


def calls(tmp_path: Path) -> list[str]:
    state = tmp_path / "state.txt"
    return state.read_text().split() if state.exists() else []


@pytest.fixture
def server(tmp_path):
    procs = []

    def start(*flags: str, dev_mode: bool = True) -> dict:
        proc, settings = launch(tmp_path, *flags, dev_mode=dev_mode)
        procs.append(proc)
        return settings

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("engine", ["auto", "vllm"])
def test_sleep_level_1_then_wake_up_in_order(tmp_path, server, engine):
    settings = {**server(), "engine": engine}
    ServerController(settings).ensure_up()
    with server_paused(settings):
        assert calls(tmp_path) == ["started", f"sleep:{engine_level()}"]
    assert calls(tmp_path) == ["started", "sleep:1", "wake_up"]
    check = next(e for e in entries(tmp_path / "logs") if e["event"] == "memory_check")
    assert check["checked"] and check["freed"]
    requested = [e for e in entries(tmp_path / "logs") if e["event"] == "stop_requested"]
    assert requested[0]["engine"] == "vllm" and requested[0]["action"] == "sleep?level=1"


def engine_level() -> int:
    return engines.VLLM_SLEEP_LEVEL


def test_a_sleep_that_frees_nothing_falls_back_to_stop_and_start(tmp_path):
    """A vLLM started without sleep mode's memory effect keeps its memory asleep: the configured stop/start takes
    over, and it comes back by start_command, not by wake_up."""
    port, pidfile, hooks = fixtures.free_port(), tmp_path / "bg.pid", tmp_path / "calls.txt"
    helper = (
        f"VLLM_SERVER_DEV_MODE=1 {sys.executable} {HELPER} --port {port} --state {tmp_path / 'state.txt'} "
        f"--memory-file {tmp_path / 'gpu_mib'} --keeps-memory"
    )
    settings = {
        "kind": "release",
        "base_url": f"http://127.0.0.1:{port}",
        "log_dir": str(tmp_path / "logs"),
        "health_timeout_s": 30.0,
        "release_check_s": 1.0,
        "memory_probe": f"cat {tmp_path / 'gpu_mib'}",
        "start_command": f"echo start >> {hooks}; {helper} >/dev/null 2>&1 & echo $! > {pidfile}",
        "stop_command": f"echo stop >> {hooks}; kill $(cat {pidfile})",
    }
    ctl = ServerController(settings)
    try:
        ctl.ensure_up()
        with server_paused(settings):
            assert not ctl.is_healthy()
        assert ctl.is_healthy()
        assert calls(tmp_path) == ["started", "sleep:1", "started"]
        assert hooks.read_text().split() == ["start", "stop", "start"]
        check = next(e for e in entries(tmp_path / "logs") if e["event"] == "memory_check")
        assert check["freed"] is False and check["after_mib"] == BUSY_MIB
    finally:
        if pidfile.exists():
            subprocess.run(["kill", pidfile.read_text().strip()], check=False)


def test_a_sleep_that_frees_nothing_without_fallback_fails_and_wakes(tmp_path, server):
    settings = server("--keeps-memory")
    with (
        pytest.raises(ServerError, match="did not drop .* --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1"),
        server_paused(settings),
    ):
        pytest.fail("extraction must not start while the server still holds the GPU")
    assert calls(tmp_path) == ["started", "sleep:1", "wake_up"]


def test_without_dev_mode_the_sleep_route_is_missing_and_named(tmp_path, server):
    settings = server(dev_mode=False)
    with (
        pytest.raises(ServerError, match=r"/is_sleeping did not answer.*VLLM_SERVER_DEV_MODE=1"),
        server_paused(settings),
    ):
        pytest.fail("extraction must not start")
    assert calls(tmp_path) == ["started"]  # nothing was asked of it, and no outage is left recorded
    assert ServerController(settings).current_outage() is None


def test_a_broken_memory_probe_fails_before_the_server_sleeps(tmp_path, server):
    settings = {**server(), "memory_probe": "echo 'no GPUs here' >&2; exit 9"}
    with pytest.raises(ServerError, match="server.memory_probe: .* exited with 9"), server_paused(settings):
        pytest.fail("extraction must not start")
    assert calls(tmp_path) == ["started"]
    assert ServerController(settings).current_outage() is None


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_or_interrupted_extraction_wakes_it(tmp_path, server, error):
    settings = server()
    with pytest.raises(error), server_paused(settings):
        raise error("extraction failed")
    assert calls(tmp_path) == ["started", "sleep:1", "wake_up"]
    assert ServerController(settings).current_outage() is None


def test_sigterm_during_extraction_wakes_it(tmp_path, server):
    settings = server()
    job = pauser(settings, 60)
    assert job.stdout.readline().strip() == "inside"
    assert calls(tmp_path) == ["started", "sleep:1"]
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode != 0 and "Terminated" in err
    assert calls(tmp_path) == ["started", "sleep:1", "wake_up"]
