"""ServerController and server_paused against real processes: a tiny stdlib HTTP server (fast) for the
process mechanics, and a real `transformers serve` of a tiny Qwen3.5 target for the pause round trip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_eval import cli
from dflash_eval.errors import DflashEvalError
from dflash_eval.server.control import ServerController, ServerError, server_paused
from dflash_eval.server.http import port_open
from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.server_control import entries, make, pauser, transitions

# ----- helpers -----


def server_side(state: Path) -> list[str]:
    """What the tiny server itself recorded: `started` at each start, then each memory call."""
    return state.read_text().split() if state.exists() else []


def background_commands(tmp_path: Path, port: int, *flags: str) -> dict:
    """start/stop commands that run the tiny server in the background (as systemd or docker would),
    each call appended to calls.txt."""
    pidfile, calls = tmp_path / "bg.pid", tmp_path / "calls.txt"
    return {
        "start_command": f"echo start >> {calls}; {sys.executable} {hs.HELPER_SCRIPT} --port {port} {' '.join(flags)}"
        f" >/dev/null 2>&1 & echo $! > {pidfile}",
        "stop_command": f"echo stop >> {calls}; kill $(cat {pidfile})",
    }


def kill_background(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    if pidfile.exists():
        subprocess.run(["kill", pidfile.read_text().strip()], check=False, stderr=subprocess.DEVNULL)


def release_settings(base_url: str, log_dir: Path, **extra: object) -> dict:
    return {
        "kind": "release",
        "base_url": base_url,
        "log_dir": str(log_dir),
        "health_timeout_s": 30.0,
        "release_check_s": 1.0,
        **extra,
    }


def wait_healthy(ctl: ServerController, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not ctl.is_healthy():
        assert time.monotonic() < deadline, f"{ctl.base_url} not healthy after {seconds} s"
        time.sleep(0.1)


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
    assert hs.group_members(pid) == []
    assert ctl.current_outage().was_up  # `server down` remembers that it was up ...
    ctl.ensure_up()  # ... so that `server up` (or the end-of-run hook) restores it
    assert ctl.is_healthy() and ctl.current_outage() is None
    assert transitions(tmp_path / "logs") == [
        "start_requested",
        "launched",
        "healthy",
        "pause",
        "stop_requested",
        "down",
        "start_requested",
        "launched",
        "healthy",
        "resume",
    ]
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
    assert hs.group_members(pid) == []


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
        wait_healthy(ctl)
        with pytest.raises(ServerError, match=f"this checkout did not launch it .*: it is pid {other.pid} "):
            ctl.ensure_up()  # healthy, but not this checkout's: not used
        assert ctl.launched_pid() is None
        with pytest.raises(
            ServerError,
            match=f"this checkout did not launch it .*: it is pid {other.pid} .*stop it \\(`kill {other.pid}`\\)",
        ):
            ctl.take_down()
        assert ctl.is_healthy() and ctl.current_outage() is None  # nothing was stopped, nothing to restore
    finally:
        other.kill()
        other.wait()


def test_launch_failure_shows_the_log(tmp_path, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    settings["command"] = "echo 'boom: no such model'; exit 3"
    with pytest.raises(ServerError, match="boom: no such model"):
        make(controllers, settings).ensure_up()


def test_paused_takes_down_and_restores(tmp_path, controllers):
    state = tmp_path / "state.txt"
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state)))
    ctl.ensure_up()
    first = ctl.launched_pid()
    with server_paused(ctl.settings) as paused:
        assert paused.base_url == ctl.base_url
        assert not ctl.is_healthy() and not port_open(ctl.base_url)
        assert hs.group_members(first) == []
    assert ctl.is_healthy()
    assert server_side(state) == ["started", "started"]
    assert transitions(tmp_path / "logs")[3:] == [
        "pause",
        "stop_requested",
        "down",
        "extraction_start",
        "extraction_end",
        "start_requested",
        "launched",
        "healthy",
        "resume",
    ]
    assert ctl.current_outage() is None


def test_paused_restores_after_an_exception(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    with pytest.raises(KeyboardInterrupt), server_paused(ctl.settings):
        raise KeyboardInterrupt  # Ctrl-C
    assert ctl.is_healthy()
    end = next(e for e in entries(tmp_path / "logs") if e["event"] == "extraction_end")
    assert end["ok"] is False and end["error"] == "KeyboardInterrupt"


def test_two_extractions_at_once_share_one_outage(tmp_path, controllers):
    """Two jobs pause together: the server goes down once, their extractions run one after the other,
    and it is started exactly once, after the last (seen from the server's own record)."""
    state = tmp_path / "state.txt"
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state)))
    ctl.ensure_up()
    go = tmp_path / "go"
    jobs = [pauser(ctl.settings, 0, until=go) for _ in range(2)]
    deadline = time.monotonic() + 60
    while not {"pause", "joined"} <= set(transitions(tmp_path / "logs")):  # both arrived; one is extracting
        assert time.monotonic() < deadline and all(job.poll() is None for job in jobs)
        time.sleep(0.05)
    go.touch()
    outputs = [job.communicate(timeout=120) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert ctl.is_healthy()
    assert server_side(state) == ["started", "started"]  # before, and once after both
    events = entries(tmp_path / "logs")[3:]
    names = [e["event"] for e in events]
    assert names.count("pause") == 1 and names.count("joined") == 1 and names.count("resume") == 1
    assert names.count("launched") == 1 and names.index("launched") > max(
        i for i, n in enumerate(names) if n == "extraction_end"
    )
    windows = [n for n in names if n.startswith("extraction_")]
    assert windows == ["extraction_start", "extraction_end"] * 2  # serialized, never overlapping
    assert {e["by_pid"] for e in events if e["event"] == "extraction_start"} == {job.pid for job in jobs}


def test_fetch_waits_while_another_job_holds_the_server_down(tmp_path, controllers):
    """ensure_up (what fetch calls first) neither restarts the server under a running extraction nor
    gives up: it waits for that job to bring the server back."""
    state = tmp_path / "state.txt"
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state)))
    ctl.ensure_up()
    job = pauser(ctl.settings, 2.0)
    assert job.stdout.readline().strip() == "inside"
    ServerController(ctl.settings).ensure_up()
    assert ctl.is_healthy()
    assert job.wait(timeout=60) == 0
    assert server_side(state) == ["started", "started"]  # the job's restore, not a second launch of ours
    resume = next(e for e in entries(tmp_path / "logs") if e["event"] == "resume")
    assert resume["by_pid"] == job.pid


def test_fetch_wait_for_another_jobs_outage_is_bounded(tmp_path, controllers):
    """A job that holds the server down longer than outage_wait_s makes ensure_up fail, naming it."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    job = pauser(ctl.settings, 30.0)
    assert job.stdout.readline().strip() == "inside"
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"held down for \d+ s \(server.outage_wait_s=1.0\) by .*{job.pid}"):
        ServerController({**ctl.settings, "outage_wait_s": 1.0}).ensure_up()
    assert time.monotonic() - start < 10
    assert job.poll() is None  # the holder's extraction was left alone
    job.terminate()
    assert job.wait(timeout=60) != 0 and ctl.is_healthy()  # its SIGTERM restore brought the server back


def test_health_wait_is_bounded(tmp_path):
    settings = {
        "kind": "external",
        "base_url": f"http://127.0.0.1:{fixtures.free_port()}",
        "log_dir": str(tmp_path / "logs"),
        "start_command": "echo 'starting nothing'",
        "stop_command": "true",
        "health_timeout_s": 1.0,
    }
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"(?s)not healthy .* after server.health_timeout_s=1.0 s.*starting nothing"):
        ServerController(settings).ensure_up()
    assert time.monotonic() - start < 10


def test_paused_down_server_stays_down(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    with server_paused(ctl.settings):
        assert not ctl.is_healthy()
    assert not ctl.is_healthy() and not port_open(ctl.base_url)
    assert ctl.launched_pid() is None
    assert transitions(tmp_path / "logs") == ["pause", "extraction_start", "extraction_end", "resume"]
    assert entries(tmp_path / "logs")[-1]["restored"] is False


def test_paused_restores_after_sigterm_and_finish_leaves_no_orphan(tmp_path, controllers):
    """Snakemake cancels a job with SIGTERM: the server must come back all the same; the end-of-run
    hook (`dflash-eval server finish`) then stops it and its whole process group."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    first = ctl.launched_pid()
    proc = pauser(ctl.settings, 60)
    assert proc.stdout.readline().strip() == "inside"
    assert not ctl.is_healthy() and hs.group_members(first) == []
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Terminated" in err
    assert ctl.is_healthy()
    assert transitions(tmp_path / "logs")[-3:] == ["launched", "healthy", "resume"]
    second = ctl.launched_pid()
    assert second not in (None, first) and hs.group_members(second) == [second]
    assert cli.main(["server", "finish", "--settings", json.dumps(ctl.settings)]) == 0  # the Snakefile's hook
    assert not port_open(ctl.base_url)
    assert hs.group_members(second) == [] and hs.group_members(first) == []  # the pids and their groups


def test_sigterm_during_the_stop_is_acted_on_once_the_server_is_down(tmp_path, controllers):
    """A SIGTERM that lands while the server is being stopped must not leave it half-stopped: the stop
    completes (down), the extraction never starts, and the server is restored."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", "--ignore-sigterm", stop_grace_s=1.0))
    ctl.ensure_up()
    proc = pauser(ctl.settings, 60)
    deadline = time.monotonic() + 60
    while "stop_requested" not in transitions(tmp_path / "logs"):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the server ignores SIGTERM: its stop takes stop_grace_s, then SIGKILL
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Terminated" in err and "inside" not in out
    assert ctl.is_healthy()
    assert transitions(tmp_path / "logs")[3:] == [
        "pause",
        "stop_requested",
        "down",
        "start_requested",
        "launched",
        "healthy",
        "resume",
    ]


def test_a_failed_restart_after_the_block_is_reported_kept_and_retried(tmp_path, controllers):
    """The block succeeded, the server does not come back: the block's work stands (the job succeeds), the
    failure is logged with the log tail, what is on disk and the command that retries it, and `server up`
    retries it (issue 32)."""
    flag = tmp_path / "started-once"
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    settings["command"] = (
        f"if [ -e {flag} ]; then echo 'boom: CUDA out of memory while loading'; exit 1; fi; "
        f"touch {flag}; {settings['command']}"
    )
    ctl = make(controllers, settings)
    ctl.ensure_up()
    proc = pauser(settings, 0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "done" in out, err
    assert "did not come back" in err and "boom: CUDA out of memory while loading" in err
    assert str(tmp_path / "logs" / "server.log") in err and "dflash-eval server up" in err
    events = transitions(tmp_path / "logs")
    assert "resume" not in events and events[-1] == "restore_failed"  # the report flags it as never restored
    record = json.loads((tmp_path / "logs" / "outage.json").read_text())  # the file the message names is there
    assert record["holders"] == [] and "exited before it became healthy" in record["restore_error"]
    assert not ctl.is_healthy()
    flag.unlink()  # what was wrong is fixed: `server up` retries the restore
    assert cli.main(["server", "up", "--settings", json.dumps(settings)]) == 0
    assert ctl.is_healthy() and not (tmp_path / "logs" / "outage.json").exists()
    assert transitions(tmp_path / "logs")[-1] == "resume"


def test_finish_restores_what_a_killed_job_left_down(tmp_path, controllers):
    """A job killed with SIGKILL cannot restore anything: the end-of-run hook (or the next job) does."""
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs", keep_running=True))
    ctl.ensure_up()
    proc = pauser(ctl.settings, 60)
    assert proc.stdout.readline().strip() == "inside"
    proc.kill()
    proc.wait()
    assert not ctl.is_healthy() and ctl.current_outage().holders == []  # its holder is pruned as dead
    ServerController(ctl.settings).finish()
    assert ctl.is_healthy() and ctl.current_outage() is None
    assert transitions(tmp_path / "logs")[-1] == "resume"


def test_a_corrupt_outage_record_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "outage.json").write_text('{"was_up": tr')  # torn by hand or a full disk
    with pytest.raises(DflashEvalError, match=r"(?s)outage.json: not an outage record .* then delete this file"):
        ServerController(hs.tiny_helper_settings(tmp_path / "logs")).ensure_up()


def test_external_kind_runs_the_commands_in_order(tmp_path):
    port = fixtures.free_port()
    settings = {
        "kind": "external",
        "base_url": f"http://127.0.0.1:{port}",
        "health_timeout_s": 30.0,
        "log_dir": str(tmp_path / "logs"),
        **background_commands(tmp_path, port),
    }
    ctl = ServerController(settings)
    try:
        ctl.ensure_up()
        with server_paused(settings):
            assert not ctl.is_healthy()
            assert (tmp_path / "calls.txt").read_text().split() == ["start", "stop"]
        assert ctl.is_healthy()
        assert (tmp_path / "calls.txt").read_text().split() == ["start", "stop", "start"]
    finally:
        kill_background(tmp_path)


def test_release_kind_calls_both_endpoints_in_order(tmp_path):
    state, memory = tmp_path / "state.txt", tmp_path / "gpu_mib"
    settings = hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state), "--memory-file", str(memory))
    proc = subprocess.Popen(settings["command"], shell=True)
    release = release_settings(settings["base_url"], tmp_path / "logs", memory_probe=f"cat {memory}")
    try:
        ctl = ServerController(release)
        ctl.ensure_up()  # waits for health; sends no resume: nothing was released
        with server_paused(release):
            assert server_side(state) == ["started", "release_memory_occupation"]
        assert server_side(state) == ["started", "release_memory_occupation", "resume_memory_occupation"]
        assert ctl.is_healthy() and proc.poll() is None  # never stopped, never started
        check = next(e for e in entries(tmp_path / "logs") if e["event"] == "memory_check")
        assert check["checked"] and check["freed"] and check["before_mib"] - check["after_mib"] >= 1024
    finally:
        proc.kill()
        proc.wait()


def test_release_that_frees_nothing_falls_back_to_stop_and_start(tmp_path):
    """A server started without --enable-memory-saver answers the release but keeps its memory: the
    configured stop/start takes over, and it comes back by start_command, not by resume."""
    port = fixtures.free_port()
    state = tmp_path / "state.txt"
    settings = release_settings(
        f"http://127.0.0.1:{port}",
        tmp_path / "logs",
        memory_probe=f"echo {hs.BUSY_MIB}",
        **background_commands(tmp_path, port, "--state", str(state)),
    )
    ctl = ServerController(settings)
    try:
        ctl.ensure_up()
        with server_paused(settings):
            assert not ctl.is_healthy()
        assert ctl.is_healthy()
        assert server_side(state) == ["started", "release_memory_occupation", "started"]
        assert (tmp_path / "calls.txt").read_text().split() == ["start", "stop", "start"]
        check = next(e for e in entries(tmp_path / "logs") if e["event"] == "memory_check")
        assert check["freed"] is False and check["after_mib"] == hs.BUSY_MIB
    finally:
        kill_background(tmp_path)


def test_release_that_frees_nothing_without_fallback_fails_and_resumes(tmp_path):
    state = tmp_path / "state.txt"
    settings = hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state))
    proc = subprocess.Popen(settings["command"], shell=True)
    release = release_settings(settings["base_url"], tmp_path / "logs", memory_probe=f"echo {hs.BUSY_MIB}")
    try:
        wait_healthy(ServerController(release))
        with pytest.raises(ServerError, match="did not drop .* --enable-memory-saver"), server_paused(release):
            pytest.fail("extraction must not start while the server still holds the GPU")
        assert server_side(state) == ["started", "release_memory_occupation", "resume_memory_occupation"]
        assert ServerController(release).is_healthy()
    finally:
        proc.kill()
        proc.wait()


def test_a_broken_memory_probe_fails_before_anything_is_released(tmp_path):
    state = tmp_path / "state.txt"
    settings = hs.tiny_helper_settings(tmp_path / "logs", "--state", str(state))
    proc = subprocess.Popen(settings["command"], shell=True)
    release = release_settings(settings["base_url"], tmp_path / "logs", memory_probe="echo 'no GPUs here' >&2; exit 9")
    try:
        wait_healthy(ServerController(release))
        with (
            pytest.raises(ServerError, match="server.memory_probe: .* exited with 9: no GPUs here"),
            server_paused(release),
        ):
            pytest.fail("extraction must not start")
        assert server_side(state) == ["started"]  # neither released nor resumed
        assert ServerController(release).current_outage() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or torch.cuda.is_available(), reason="this machine can read its GPU memory"
)
def test_release_without_a_readable_gpu_says_it_could_not_check(tmp_path):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    proc = subprocess.Popen(settings["command"], shell=True)
    release = release_settings(settings["base_url"], tmp_path / "logs")
    try:
        wait_healthy(ServerController(release))
        with server_paused(release):
            pass
        check = next(e for e in entries(tmp_path / "logs") if e["event"] == "memory_check")
        assert check["checked"] is False and "no nvidia-smi on PATH" in check["reason"]
    finally:
        proc.kill()
        proc.wait()


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


# ----- server.pid: the server's pid, and its whole process group stopped -----


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def wait_port_closed(base_url: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while port_open(base_url):
        assert time.monotonic() < deadline, f"{base_url} still open after {seconds} s"
        time.sleep(0.05)


def launched_in_shell(tmp_path: Path, controllers: list) -> tuple[ServerController, dict]:
    """A managed server whose command runs under /bin/sh (no exec) and that starts a child process; returns
    the controller and what server.pid records once it is healthy."""
    settings = hs.in_shell(hs.tiny_helper_settings(tmp_path / "logs", "--child"), tmp_path)
    ctl = make(controllers, settings)
    ctl.ensure_up()
    return ctl, json.loads((tmp_path / "logs" / "server.pid").read_text())


def test_server_pid_is_the_server_and_killing_it_leaves_nothing_after_finish(tmp_path, controllers):
    """server.pid names the process that serves the port, not the shell its command runs in; killing that
    pid stops the server, and the end-of-run hook stops what it left in its process group."""
    ctl, record = launched_in_shell(tmp_path, controllers)
    pid, group = record["pid"], record["pgid"]
    assert ctl.launched_pid() == pid != group  # the shell leads the group; the pid on record is the server's
    assert str(hs.HELPER_SCRIPT) in cmdline(pid) and "--port" in cmdline(pid)
    assert cmdline(group)[0] == "/bin/sh"
    assert len(hs.group_members(group)) == 3  # the shell, the server and its child
    os.kill(pid, signal.SIGKILL)  # what a user does with server.pid, in its harshest form
    wait_port_closed(ctl.base_url)
    deadline = time.monotonic() + 10  # the shell exits once it has reaped the server: not at once on a busy machine
    while len(left := hs.group_members(group)) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(left) == 1 and str(hs.HELPER_SCRIPT) not in cmdline(left[0])  # the child outlived the server
    assert cli.main(["server", "finish", "--settings", json.dumps(ctl.settings)]) == 0
    assert hs.group_members(group) == []
    assert not (tmp_path / "logs" / "server.pid").exists()


def test_a_server_whose_shell_was_killed_is_still_stopped_and_restored(tmp_path, controllers):
    """The orphan that a killed shell used to leave (healthy, unowned, refused as not this checkout's launch)
    is still dflash-eval's: a pause stops its whole group and brings it back, and finish stops the new one."""
    ctl, record = launched_in_shell(tmp_path, controllers)
    group = record["pgid"]
    os.kill(group, signal.SIGKILL)  # the shell: the pid that server.pid used to hold
    assert ctl.is_healthy() and record["pid"] in hs.group_members(group)
    with server_paused(ctl.settings):
        assert not ctl.is_healthy() and hs.group_members(group) == []
    assert ctl.is_healthy()
    new_group = json.loads((tmp_path / "logs" / "server.pid").read_text())["pgid"]
    assert new_group != group and len(hs.group_members(new_group)) == 3
    ServerController(ctl.settings).finish()
    assert hs.group_members(new_group) == [] and not port_open(ctl.base_url)


def test_what_a_killed_server_left_is_stopped_by_the_next_pause_and_up(tmp_path, controllers):
    """Killed by hand, the server is down: the next extraction leaves it down but stops what remains of its
    group (it would hold the GPU), and the next `up` launches a new server."""
    ctl, record = launched_in_shell(tmp_path, controllers)
    pid, group = record["pid"], record["pgid"]
    os.kill(pid, signal.SIGTERM)
    wait_port_closed(ctl.base_url)
    assert hs.group_members(group) != []
    with server_paused(ctl.settings):
        assert hs.group_members(group) == []
    assert not ctl.is_healthy()  # it was down before the extraction: it stays down
    ctl.ensure_up()
    assert ctl.launched_pid() not in (None, pid)


def test_server_up_replaces_what_a_killed_server_left(tmp_path, controllers):
    ctl, record = launched_in_shell(tmp_path, controllers)
    pid, group = record["pid"], record["pgid"]
    os.kill(pid, signal.SIGKILL)
    wait_port_closed(ctl.base_url)
    assert hs.group_members(group) != []
    assert cli.main(["server", "up", "--settings", json.dumps(ctl.settings)]) == 0
    assert hs.group_members(group) == [] and ctl.is_healthy() and ctl.launched_pid() not in (None, pid)
    assert "its server process is gone" in next(
        e.get("reason", "") for e in entries(tmp_path / "logs") if e["event"] == "stop_requested"
    )


def test_server_help_explains_every_action_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["server", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for explained in [
        "up make the server healthy",
        "down take the server down",
        "status print the state as JSON",
        "stop-launched stop the managed server that dflash-eval launched",
        "finish the end-of-run hook",
        "exits 0 when the server is healthy, 3 when it is not",
        "3 from status: the server is not healthy",
    ]:
        assert explained in text, (explained, text)


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
    assert events[-9:] == [
        "pause",
        "stop_requested",
        "down",
        "extraction_start",
        "extraction_end",
        "start_requested",
        "launched",
        "healthy",
        "resume",
    ]


def test_two_checkouts_on_one_port_the_second_is_told_whose_server_it_is(tmp_path, controllers):
    """Issue 32: the second checkout used the first's server silently, then failed with a bare connection error.
    Two checkout directories, the first's server launched by the real `dflash-eval server up` run there."""
    first, second = tmp_path / "first", tmp_path / "second"
    settings = hs.tiny_helper_settings(Path("results/logs/server"))  # log_dir relative, as config.yaml has it
    first.mkdir()
    second.mkdir()
    up = subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", "server", "up", "--settings", json.dumps(settings)],
        cwd=first,
        capture_output=True,
        text=True,
        timeout=120,
    )
    record_file = first / "results" / "logs" / "server" / "server.pid"
    assert up.returncode == 0, up.stderr
    record = record_file.read_bytes()
    controllers.append(ServerController({**settings, "log_dir": str(first / "results/logs/server")}))
    server = json.loads(record)["pid"]
    for action in ("up", "down"):
        run = subprocess.run(
            [sys.executable, "-m", "dflash_eval.cli", "server", action, "--settings", json.dumps(settings)],
            cwd=second,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, run.stderr
        text = " ".join(run.stderr.split())
        assert (
            f"the server at {settings['base_url']} is up, but this checkout did not launch it "
            f"(results/logs/server/server.pid names no live launch): it is pid {server} (`" in text
        )
        assert f", started in {first}; that checkout's {record_file} has it on record." in text
        assert (
            f"Give this checkout a port of its own (server.base_url and the port in server.command), or stop "
            f"it from there (`cd {first} && dflash-eval server stop-launched --config config.yaml`)" in text
        )
    assert record_file.read_bytes() == record and hs.group_members(json.loads(record)["pgid"]), "the first's is kept"
    assert ServerController({**settings, "log_dir": str(first / "results/logs/server")}).is_healthy()
    assert not (second / "results" / "logs" / "server" / "server.pid").exists()
    assert not (second / "results" / "logs" / "server" / "outage.json").exists(), "nothing taken down"
