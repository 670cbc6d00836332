"""Control of the inference server that fetch reads from and extract must pause.

Three kinds share one interface (see DESIGN.md, "Server control"):
- ``managed``: we launch ``command`` ourselves, in its own process group, and own the process;
- ``external``: someone else owns it; we run ``start_command`` / ``stop_command``;
- ``release``: SGLang with ``--enable-memory-saver``; we ask it to release / resume its GPU memory,
  check that the GPU memory really dropped, and fall back to ``stop_command`` / ``start_command``
  when it did not.

Extraction jobs share one outage (see outage.py): the first takes the server down, later ones join,
extractions run one at a time, and the last one out brings the server back, once. Every transition
is logged as a JSON line with a timestamp to ``log_dir/transitions.jsonl``, so that a run that left
the server down can be diagnosed afterwards, and the report can show how long the server was away.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from dflash_eval.config import server_settings, settings_from_args, stage_settings
from dflash_eval.server import gpu_memory
from dflash_eval.server import outage
from dflash_eval.errors import DflashEvalError, Terminated
from dflash_eval.io_utils import atomic_write_text
from dflash_eval.server.outage import Outage, process_start_ticks

log = logging.getLogger(__name__)

POLL_S = 0.25
WAIT_LOG_S = 60.0  # how often a job waiting for another job's outage says so
LOG_TAIL_CHARS = 3000


class ServerError(DflashEvalError):
    """The server could not be brought to the requested state; the message says what to look at."""


def http_request(url: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body), status 0 when nothing answered.

    A POST sends an empty JSON object: SGLang's release/resume endpoints parse the body as a request
    object and answer 422 to an empty one.
    """
    data, headers = (b"{}", {"Content-Type": "application/json"}) if method == "POST" else (None, {})
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def port_open(base_url: str) -> bool:
    """Whether something accepts TCP connections at the URL's host and port."""
    parts = urllib.parse.urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-LOG_TAIL_CHARS:]


class ServerController:
    """Bring one server up or down, whatever its kind; every method is safe to repeat."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = stage_settings("server", settings)
        self.kind: str = self.settings["kind"]
        self.base_url: str = self.settings["base_url"]
        self.log_dir = Path(self.settings["log_dir"])
        self.pid_file = self.log_dir / "server.pid"
        self.server_log = self.log_dir / "server.log"
        self.lock_file = self.log_dir / "server.lock"  # held for each transition (short)
        self.gpu_lock_file = self.log_dir / "extract.lock"  # held for each extraction (long)
        self.outage_file = self.log_dir / "outage.json"
        self._proc: subprocess.Popen[bytes] | None = None

    # ----- state -----

    def is_healthy(self) -> bool:
        """True when the health endpoint answers 200."""
        status, _ = http_request(self.base_url + self.settings["health_path"], timeout=5.0)
        return status == 200

    def launched_pid(self) -> int | None:
        """The pid of the managed server this workflow launched, if it still runs."""
        try:
            info = json.loads(self.pid_file.read_text())
        except (OSError, ValueError):
            return None
        if self._proc is not None:
            self._proc.poll()  # reap our own child if it exited, so it is not mistaken for a live one
        pid = int(info.get("pid", 0))
        if info.get("base_url") != self.base_url or pid <= 0 or process_start_ticks(pid) != info.get("start_ticks"):
            return None
        return pid

    def current_outage(self) -> Outage | None:
        """The outage dflash-eval holds now (dead holders pruned), or None."""
        return outage.load(self.outage_file)

    def record(self, event: str, **extra: Any) -> None:
        """Append one transition to transitions.jsonl and to the Python log."""
        now = datetime.now().astimezone()
        entry = {
            "time": now.isoformat(timespec="milliseconds"),
            "unix": round(now.timestamp(), 3),
            "event": event,
            "kind": self.kind,
            "base_url": self.base_url,
            "by_pid": os.getpid(),
            **extra,
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "transitions.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        log.info("server %s: %s %s", self.base_url, event, json.dumps(extra) if extra else "")

    # ----- outages (all under the host lock) -----

    def join_outage(self) -> None:
        """Take the server down for this process's extraction, or join the outage another job began."""
        with host_lock(self.lock_file):
            current = self.current_outage()
            if current is None:
                self._begin_outage(outage.this_process())
                return
            current.holders.append(outage.this_process())
            outage.save(self.outage_file, current)
            self.record("joined", holders=len(current.holders), was_up=current.was_up, how=current.how)

    def leave_outage(self) -> None:
        """This process no longer needs the server down; the last holder out restores it (if it was up)."""
        with host_lock(self.lock_file):
            current = self.current_outage()
            if current is None:
                return
            me = outage.this_process()
            current.holders = [h for h in current.holders if h != me]
            outage.save(self.outage_file, current)  # without us, before a restore that may fail
            if current.holders:
                self.record("left", holders=len(current.holders))
                return
            self._end_outage(current)

    def take_down(self) -> None:
        """`server down`: take the server down until `server up` or the end of the run restores it."""
        with host_lock(self.lock_file):
            if self.current_outage() is None:
                self._begin_outage(None)

    def _begin_outage(self, holder: dict | None) -> None:
        """Record the outage first (so that a crash mid-stop still leaves something to restore from), then stop."""
        was_up = self.is_healthy()
        self.record("pause", was_up=was_up)
        current = Outage(was_up=was_up, holders=[holder] if holder else [])
        outage.save(self.outage_file, current)
        if not was_up:
            return
        try:
            self._stop(current)
        except BaseException:
            if current.how is None:  # failed before anything was stopped: there is no outage to remember
                outage.clear(self.outage_file)
                self.record("resume", restored=True, reason="the stop failed before anything was stopped")
            raise

    def _end_outage(self, current: Outage) -> None:
        """Bring the server back if it was up before the outage, then forget the outage."""
        if current.was_up:
            try:
                self._bring_up(current.how)
            except ServerError as error:  # the outage stays recorded, so every later run retries the restore
                raise ServerError(f"{error}; the outage stays recorded in {self.outage_file} and every later run "
                                  "retries this restore: bring the server back by hand, then delete that file") from error
        outage.clear(self.outage_file)
        self.record("resume", restored=current.was_up)

    def _note(self, current: Outage, how: str) -> None:
        """Record how the server is about to be taken down, before doing it."""
        current.how = how
        outage.save(self.outage_file, current)

    # ----- up -----

    def ensure_up(self) -> None:
        """Make the server healthy (launch, start or resume it); raise ServerError when it will not come.

        While another process's extraction holds the server down, wait for it, at most outage_wait_s; an
        outage whose holders died (or one that `server down` began) is ended first, restoring the server
        the way it went down.
        """
        announced, started = 0.0, time.monotonic()
        while True:
            if not self.outage_file.exists() and self.is_healthy():
                return  # the common case: nothing to restore, nothing to wait for, no lock needed
            with host_lock(self.lock_file):
                current = self.current_outage()
                if current is None or not current.holders:
                    if current is not None:
                        self._end_outage(current)
                    self._bring_up(None)
                    return
            waited = time.monotonic() - started
            if waited > float(self.settings["outage_wait_s"]):
                raise ServerError(
                    f"server {self.base_url} has been held down for {waited:.0f} s (server.outage_wait_s="
                    f"{self.settings['outage_wait_s']}) by the extraction of {current.holders} (recorded in "
                    f"{self.outage_file}); wait for that job, raise server.outage_wait_s, or end a stuck one "
                    "(its restore runs in `finally`; `dflash-eval server finish` restores what it left down)")
            if time.monotonic() - announced > WAIT_LOG_S:
                log.info("server %s is held down by %s for their extraction: waiting", self.base_url, current.holders)
                announced = time.monotonic()
            time.sleep(4 * POLL_S)

    def _bring_up(self, how: str | None) -> None:
        """Resume, start or launch the server and wait for health; `how` is how we took it down, if we did."""
        if how == "released":
            self.record("start_requested", action="resume_memory_occupation")
            self._post("/resume_memory_occupation")
            self.wait_healthy()
            return
        if self.is_healthy():
            return
        if self.settings["start_command"]:  # external, or release with its stop/start fallback
            self.record("start_requested")
            self._run_hook(self.settings["start_command"])
        elif self.kind == "managed":
            self.record("start_requested")
            pid = self.launched_pid()
            if pid is not None and how is not None:  # our own stop was interrupted: finish it first
                self._stop_group(pid)
            if self.launched_pid() is None:
                self._launch()
            # else: our server is still starting (launched by an earlier call or process); just wait.
        self.wait_healthy()

    def wait_healthy(self) -> None:
        """Poll the health endpoint until it answers, bounded by health_timeout_s."""
        start = time.monotonic()
        deadline = start + float(self.settings["health_timeout_s"])
        while time.monotonic() < deadline:
            if self.is_healthy():
                self.record("healthy", waited_s=round(time.monotonic() - start, 2))
                return
            if self.kind == "managed" and (self._exited() or self.launched_pid() is None):
                raise ServerError(
                    f"the managed server exited before it became healthy; {self.server_log} ends with:\n"
                    + _log_tail(self.server_log)
                )
            time.sleep(POLL_S)
        where = (f"{self.server_log} ends with:\n{_log_tail(self.server_log)}"
                 if self.kind == "managed" or self.settings["start_command"]
                 else "a release-kind server without start_command is started by you, not by dflash-eval")
        raise ServerError(
            f"server at {self.base_url} not healthy ({self.settings['health_path']}) after "
            f"server.health_timeout_s={self.settings['health_timeout_s']} s; {where}"
        )

    def _exited(self) -> bool:
        """Whether the server this controller launched has exited (False if it launched none)."""
        return self._proc is not None and self._proc.poll() is not None

    def _launch(self) -> None:
        if port_open(self.base_url):
            raise ServerError(
                f"port of {self.base_url} is in use by something that is not a healthy server "
                f"({self.settings['health_path']} does not answer 200) and that dflash-eval did not launch; "
                "stop it or choose another port"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = self.settings["command"]
        with open(self.server_log, "ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {command}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                command,
                shell=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: we can signal the server and all its children
            )
        pid = self._proc.pid
        info = {"pid": pid, "start_ticks": process_start_ticks(pid), "command": command, "base_url": self.base_url}
        atomic_write_text(self.pid_file, json.dumps(info))
        self.record("launched", pid=pid, command=command)

    # ----- down -----

    def _stop(self, current: Outage) -> None:
        """Stop the server (or release its memory) and wait until it is down; notes how in `current`."""
        if self.kind == "release":
            self._release(current)
        elif self.kind == "external":
            self._note(current, "stopped")
            self._stop_by_command()
        else:
            self._stop_launched(current)

    def _stop_launched(self, current: Outage) -> None:
        pid = self.launched_pid()
        if pid is None:
            raise ServerError(
                f"the managed server at {self.base_url} is up but was not launched by dflash-eval "
                f"(no live pid in {self.pid_file}); stop it yourself or use kind: external"
            )
        self._note(current, "stopped")
        self._stop_pid(pid)

    def _stop_pid(self, pid: int, **details: Any) -> None:
        """Stop the launched server's process group, recorded before and after."""
        self.record("stop_requested", pid=pid, **details)
        self._stop_group(pid)
        self.record("down", pid=pid)

    def _release(self, current: Outage) -> None:
        """POST /release_memory_occupation; if the GPU memory did not drop, stop the server instead."""
        before = self._read_gpu_memory()  # a broken probe fails here, before anything changed
        self._note(current, "released")
        self.record("stop_requested", action="release_memory_occupation")
        self._post("/release_memory_occupation")
        if self._memory_dropped(before):
            self.record("down", action="release_memory_occupation")
            return
        if not self.settings["stop_command"]:
            raise ServerError(
                f"POST {self.base_url}/release_memory_occupation answered 200 but the GPU memory in use did not drop "
                f"by server.release_min_drop_gib={self.settings['release_min_drop_gib']} GiB (see memory_check in "
                f"{self.log_dir / 'transitions.jsonl'}): start SGLang with --enable-memory-saver, or set "
                "server.stop_command and server.start_command as a fallback (release_min_drop_gib: 0 skips the check)"
            )
        self._note(current, "stopped")
        self._stop_by_command(reason="release did not free the GPU memory")

    def _read_gpu_memory(self) -> gpu_memory.Reading:
        probe = self.settings["memory_probe"]
        reading = gpu_memory.used_mib(probe)
        if probe and reading.mib is None:
            raise ServerError(f"server.memory_probe: {reading.source}; it must print the used GPU memory in MiB "
                              "(one number per GPU), or set it to null to use nvidia-smi")
        return reading

    def _memory_dropped(self, before: gpu_memory.Reading) -> bool:
        """Whether the GPU memory in use fell by release_min_drop_gib within release_check_s; True when it
        cannot be read (logged as unchecked), since then only the extraction itself can tell."""
        needed = float(self.settings["release_min_drop_gib"]) * 1024
        if needed <= 0 or before.mib is None:
            reason = "server.release_min_drop_gib is 0" if needed <= 0 else before.source
            self.record("memory_check", checked=False, reason=f"GPU memory could not be checked: {reason}")
            return True
        deadline = time.monotonic() + float(self.settings["release_check_s"])
        while True:
            after = self._read_gpu_memory()
            dropped = after.mib is not None and before.mib - after.mib >= needed
            if dropped or time.monotonic() >= deadline:
                self.record("memory_check", checked=True, freed=dropped, before_mib=before.mib, after_mib=after.mib,
                            needed_mib=needed, source=before.source)
                return dropped
            time.sleep(2 * POLL_S)

    def _stop_by_command(self, **extra: Any) -> None:
        self.record("stop_requested", **extra)
        self._run_hook(self.settings["stop_command"])
        self._wait_unhealthy(float(self.settings["stop_grace_s"]) + 30.0)
        self.record("down")

    def stop_if_launched(self) -> bool:
        """Stop the managed server that dflash-eval launched, unless keep_running; True if one was stopped."""
        if self.kind != "managed":
            return False
        pid = self.launched_pid()
        if pid is None:
            return False
        if self.settings["keep_running"]:
            log.info("server %s (pid %d) left running: keep_running is set", self.base_url, pid)
            return False
        self._stop_pid(pid, reason="stop-launched")
        return True

    def finish(self) -> None:
        """End of a run (Snakemake's onsuccess/onerror): restore what a job that died left down, then stop
        the server the run launched unless keep_running. Idempotent; leaves live outages to their holders."""
        with host_lock(self.lock_file):
            current = self.current_outage()
            if current is not None and current.holders:
                log.info("server %s is still held down by %s: they will restore it", self.base_url, current.holders)
                return
            if current is not None:
                if self.kind == "managed" and not self.settings["keep_running"]:
                    outage.clear(self.outage_file)  # the run ends and would stop it again at once
                    self.record("resume", restored=False, reason="end of run: a launched server is not kept")
                else:
                    self._end_outage(current)
        self.stop_if_launched()

    def _stop_group(self, pid: int) -> None:
        """SIGTERM the server's process group, SIGKILL it after stop_grace_s, then wait for the port to close."""
        grace = float(self.settings["stop_grace_s"])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        if not self._wait_exit(pid, grace):
            log.warning("server pid %d ignored SIGTERM for %.0f s: sending SIGKILL", pid, grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # children that outlived the leader
        self.pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + 10.0
        while port_open(self.base_url) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:  # reaps our own child, so it leaves no zombie
                    return True
            elif process_start_ticks(pid) is None:
                return True
            time.sleep(POLL_S / 2)
        return False

    def _wait_unhealthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_healthy():
            if time.monotonic() > deadline:
                raise ServerError(f"server at {self.base_url} still healthy {timeout:.0f} s after "
                                  f"server.stop_command `{self.settings['stop_command']}`; see {self.server_log}")
            time.sleep(POLL_S)

    # ----- helpers -----

    def _run_hook(self, command: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.server_log, "ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} running: {command}\n".encode())
            out.flush()
            rc = subprocess.run(command, shell=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise ServerError(f"`{command}` exited with {rc}; {self.server_log} ends with:\n{_log_tail(self.server_log)}")

    def _post(self, path: str) -> None:
        status, body = http_request(self.base_url + path, method="POST", timeout=300.0)
        if status != 200:
            raise ServerError(f"POST {self.base_url}{path} answered {status or 'nothing'}: {body[:500]!r}"
                              + (" (SGLang needs --enable-memory-saver for this, and releases only while no "
                                 "request is running)" if "memory" in path else ""))


# ----- pausing around extraction -----


_HELD_LOCKS: dict[str, int] = {}  # lock path -> nesting depth in this process


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (shared by every dflash-eval process of this host).

    Re-entrant within one process (a second flock on a new file descriptor of the same process
    would deadlock).
    """
    key = str(Path(path).resolve())
    if _HELD_LOCKS.get(key):
        _HELD_LOCKS[key] += 1
        try:
            yield
        finally:
            _HELD_LOCKS[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for the lock %s", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        _HELD_LOCKS[key] = 1
        try:
            yield
        finally:
            del _HELD_LOCKS[key]
            fcntl.flock(fh, fcntl.LOCK_UN)


class SigtermGuard:
    """What SIGTERM does now: raise Terminated; or, during a server transition, wait until the transition is
    complete (a half-stopped server is harder to restore); or, once cleaning up, only log."""

    def __init__(self) -> None:
        self.mode = "raise"
        self.pending = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.mode == "raise":
            self.mode = "cleanup"
            raise Terminated("SIGTERM")
        if self.mode == "defer":
            self.pending = True
            log.warning("SIGTERM received during a server transition: acting on it once the transition is complete")
        else:
            log.warning("SIGTERM received again while cleaning up: finishing the cleanup first")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A SIGTERM inside the block is raised at its end."""
        self.mode = "defer"
        try:
            yield
        finally:
            if self.mode == "defer":
                self.mode = "raise"
        if self.pending:
            self.pending = False
            self.mode = "cleanup"
            raise Terminated("SIGTERM (received during a server transition)")

    def cleanup(self) -> None:
        """From now on SIGTERM only logs: the restore must finish."""
        self.mode = "cleanup"


@contextlib.contextmanager
def sigterm_raises() -> Iterator[SigtermGuard]:
    """Turn SIGTERM into a Terminated exception for the block (see SigtermGuard); restores the old handler."""
    guard = SigtermGuard()
    if threading.current_thread() is not threading.main_thread():
        log.warning("not in the main thread: SIGTERM will not restore the server")
        yield guard
        return
    previous = signal.signal(signal.SIGTERM, guard.handle)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def server_paused(settings: dict[str, Any]) -> Iterator[ServerController]:
    """Free the server's GPU for the block, and bring the server back after it if it was up.

    Jobs that pause at the same time share one outage: the server goes down once, their blocks run
    one at a time (the GPU lock), and it comes back once, after the last. Restores also on
    exceptions, Ctrl-C and SIGTERM.
    """
    ctl = ServerController(settings)
    with sigterm_raises() as guard:
        try:
            with guard.deferred():
                ctl.join_outage()
            with host_lock(ctl.gpu_lock_file):  # one extraction at a time; the server stays down between them
                ctl.record("extraction_start")
                try:
                    yield ctl
                except BaseException as error:
                    ctl.record("extraction_end", ok=False, error=type(error).__name__)
                    raise
                ctl.record("extraction_end", ok=True)
        finally:
            guard.cleanup()
            ctl.leave_outage()


# ----- CLI -----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-eval server {up,down,status,stop-launched,finish} --settings JSON | --config config.yaml`."""
    parser.add_argument("action", choices=["up", "down", "status", "stop-launched", "finish"],
                        help="finish: the end-of-run hook (restore what a dead job left down, stop what we launched)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--settings", help="server settings as JSON (see docs/contracts.md)")
    src.add_argument("--config", help="config.yaml to read the server settings from")


def run(args: argparse.Namespace) -> int:
    """Run one action; `status` prints JSON and exits 0 when healthy, 3 when not (as systemctl does)."""
    ctl = ServerController(settings_from_args(args, server_settings))
    actions = {"up": ctl.ensure_up, "down": ctl.take_down, "stop-launched": ctl.stop_if_launched, "finish": ctl.finish}
    if args.action in actions:
        actions[args.action]()
        return 0
    healthy = ctl.is_healthy()
    current = ctl.current_outage()
    status = {"base_url": ctl.base_url, "kind": ctl.kind, "healthy": healthy, "launched_pid": ctl.launched_pid(),
              "outage": None if current is None else vars(current)}
    print(json.dumps(status))
    return 0 if healthy else 3
