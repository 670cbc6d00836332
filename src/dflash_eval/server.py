"""Control of the inference server that fetch reads from and extract must pause.

Three kinds share one interface (see DESIGN.md, "Server control"):
- ``managed``: we launch ``command`` ourselves, in its own process group, and own the process;
- ``external``: someone else owns it; we run ``start_command`` / ``stop_command``;
- ``release``: SGLang with ``--enable-memory-saver``; we ask it to release / resume its GPU memory.

Every transition is logged as a JSON line with a timestamp to ``log_dir/transitions.jsonl``, so that
a run that left the server down can be diagnosed afterwards.
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

from dflash_eval.errors import DflashEvalError

log = logging.getLogger(__name__)

KINDS = ("managed", "external", "release")
DEFAULTS: dict[str, Any] = {
    "kind": "managed",
    "base_url": "http://127.0.0.1:8731",
    "model": None,
    "command": None,
    "start_command": None,
    "stop_command": None,
    "health_path": "/health",
    "health_timeout_s": 600.0,
    "stop_grace_s": 30.0,
    "log_dir": "results/logs/server",
    "keep_running": False,
}
POLL_S = 0.25
LOG_TAIL_CHARS = 3000


class ServerError(DflashEvalError):
    """The server could not be brought to the requested state; the message says what to look at."""


class Terminated(BaseException):
    """Raised by our SIGTERM handler so that ``finally`` blocks run (Snakemake cancels with SIGTERM).

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it.
    """


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and reject what cannot work, before anything is started or stopped."""
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise DflashEvalError(f"unknown server settings: {sorted(unknown)}")
    out = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    if out["kind"] not in KINDS:
        raise DflashEvalError(f"server kind must be one of {KINDS}, got {out['kind']!r}")
    if out["kind"] == "managed" and not out["command"]:
        raise DflashEvalError("a managed server needs `command`")
    if out["kind"] == "external" and not (out["start_command"] and out["stop_command"]):
        raise DflashEvalError("an external server needs `start_command` and `stop_command`")
    out["base_url"] = str(out["base_url"]).rstrip("/")
    return out


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


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie.

    Stored in the pid file so that a reused pid is never taken for our server.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-LOG_TAIL_CHARS:]


class ServerController:
    """Bring one server up or down, whatever its kind; every method is safe to repeat."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = resolve_settings(settings)
        self.kind: str = self.settings["kind"]
        self.base_url: str = self.settings["base_url"]
        self.log_dir = Path(self.settings["log_dir"])
        self.pid_file = self.log_dir / "server.pid"
        self.server_log = self.log_dir / "server.log"
        self.lock_file = self.log_dir / "server.lock"
        # Present while a release-kind server's memory is released by us (resume is only sent then).
        self.released_marker = self.log_dir / "server.released"
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
        if info.get("base_url") != self.base_url or pid <= 0 or _proc_start_ticks(pid) != info.get("start_ticks"):
            return None
        return pid

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

    # ----- up -----

    def ensure_up(self) -> None:
        """Make the server healthy (launch, start or resume it); raise ServerError when it will not come."""
        if self.kind == "release":
            self._resume()
            return
        if self.is_healthy():
            return
        with host_lock(self.lock_file):  # two jobs must not both launch (or start) the server
            if self.is_healthy():
                return
            self.record("start_requested")
            if self.kind == "external":
                self._run_hook(self.settings["start_command"])
            elif self.launched_pid() is None:
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
        raise ServerError(
            f"server at {self.base_url} not healthy after {self.settings['health_timeout_s']} s"
            + {
                "managed": f"; {self.server_log} ends with:\n{_log_tail(self.server_log)}",
                "external": f"; see {self.server_log} for the output of start_command",
                "release": " (a release-kind server is started by you, not by dflash-eval)",
            }[self.kind]
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
        info = {"pid": pid, "start_ticks": _proc_start_ticks(pid), "command": command, "base_url": self.base_url}
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(self.pid_file)
        self.record("launched", pid=pid, command=command)

    # ----- down -----

    def take_down(self) -> None:
        """Stop the server (or release its memory) and wait until it is down."""
        if self.kind == "release":
            if not self.released_marker.exists():
                self.record("stop_requested", action="release_memory_occupation")
                self._post("/release_memory_occupation")
                self.released_marker.touch()
                self.record("down")
            return
        if self.kind == "external":
            self.record("stop_requested")
            self._run_hook(self.settings["stop_command"])
            self._wait_unhealthy(float(self.settings["stop_grace_s"]) + 30.0)
            self.record("down")
            return
        pid = self.launched_pid()
        if pid is None:
            if self.is_healthy():
                raise ServerError(
                    f"the managed server at {self.base_url} is up but was not launched by dflash-eval "
                    f"(no live pid in {self.pid_file}); stop it yourself or use kind: external"
                )
            return
        self.record("stop_requested", pid=pid)
        self._stop_group(pid)
        self.record("down", pid=pid)

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
        self.record("stop_requested", pid=pid, reason="stop-launched")
        self._stop_group(pid)
        self.record("down", pid=pid)
        return True

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
            elif _proc_start_ticks(pid) is None:
                return True
            time.sleep(POLL_S / 2)
        return False

    def _wait_unhealthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_healthy():
            if time.monotonic() > deadline:
                raise ServerError(f"server at {self.base_url} still healthy {timeout:.0f} s after stop_command")
            time.sleep(POLL_S)

    # ----- helpers -----

    def _resume(self) -> None:
        """Resume a release-kind server's memory if we released it; we never start such a server."""
        if self.released_marker.exists():
            self.record("start_requested", action="resume_memory_occupation")
            self._post("/resume_memory_occupation")
            self.released_marker.unlink()
            self.wait_healthy()
        elif not self.is_healthy():
            self.wait_healthy()

    def _run_hook(self, command: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.server_log, "ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} running: {command}\n".encode())
            out.flush()
            rc = subprocess.run(command, shell=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise ServerError(f"`{command}` exited with {rc}; see {self.server_log}")

    def _post(self, path: str) -> None:
        status, body = http_request(self.base_url + path, method="POST", timeout=120.0)
        if status != 200:
            raise ServerError(f"POST {self.base_url}{path} answered {status or 'nothing'}: {body[:500]!r}")


# ----- pausing around extraction -----


_HELD_LOCKS: dict[str, int] = {}  # lock path -> nesting depth in this process


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (shared by every dflash-eval process of this host).

    Re-entrant within one process: server_paused holds it while ensure_up takes it again (a second
    flock on a new file descriptor of the same process would deadlock).
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
            log.info("waiting for the server lock %s", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
        _HELD_LOCKS[key] = 1
        try:
            yield
        finally:
            del _HELD_LOCKS[key]
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[list[bool]]:
    """Turn the first SIGTERM into a Terminated exception; later ones only log (so cleanup can finish).

    Yields a one-element list that the caller sets to [True] once it is cleaning up.
    """
    cleaning = [False]

    def handler(signum: int, frame: Any) -> None:
        if cleaning[0]:
            log.warning("SIGTERM received while restoring the server: finishing the restore first")
            return
        cleaning[0] = True
        raise Terminated("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        log.warning("not in the main thread: SIGTERM will not restore the server")
        yield cleaning
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield cleaning
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def server_paused(settings: dict[str, Any]) -> Iterator[ServerController]:
    """Free the server's GPU for the block, and bring the server back after it if it was up.

    Restores also on exceptions, Ctrl-C and SIGTERM. Holds the host-wide lock for the whole block so
    that no other dflash-eval process starts or uses the server meanwhile.
    """
    ctl = ServerController(settings)
    with host_lock(ctl.lock_file), sigterm_raises() as cleaning:
        was_up = ctl.is_healthy()
        ctl.record("pause", was_up=was_up)
        try:
            if was_up:
                ctl.take_down()
            yield ctl
        finally:
            cleaning[0] = True
            if was_up:
                ctl.ensure_up()
            ctl.record("resume", restored=was_up)


# ----- CLI -----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-eval server {up,down,status,stop-launched} --settings JSON | --config config.yaml`."""
    parser.add_argument("action", choices=["up", "down", "status", "stop-launched"])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--settings", help="server settings as JSON (see docs/contracts.md)")
    src.add_argument("--config", help="config.yaml to read the server settings from")


def run(args: argparse.Namespace) -> int:
    """Run one action; `status` prints JSON and exits 0 when healthy, 3 when not (as systemctl does)."""
    from dflash_eval.config import server_settings, settings_from_args

    ctl = ServerController(settings_from_args(args, server_settings))
    if args.action == "up":
        ctl.ensure_up()
    elif args.action == "down":
        ctl.take_down()
    elif args.action == "stop-launched":
        ctl.stop_if_launched()
    else:
        healthy = ctl.is_healthy()
        status = {"base_url": ctl.base_url, "kind": ctl.kind, "healthy": healthy, "launched_pid": ctl.launched_pid()}
        print(json.dumps(status))
        return 0 if healthy else 3
    return 0
