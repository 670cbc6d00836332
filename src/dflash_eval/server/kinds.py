"""The three kinds of server (`server.kind`, see docs/server.md) and how each goes down and
comes back:

- Managed: dflash-eval launches `command` in a process group of its own and owns every process in it;
- External: someone else owns the server; dflash-eval runs `stop_command` / `start_command`;
- Release: the server keeps running and gives its GPU memory back (SGLang with `--enable-memory-saver`, vLLM
  asleep at level 1 with `--enable-sleep-mode`: server.engines), checked by reading the GPU memory; when it does
  not drop, the optional stop/start commands take over (as External's).

`stop(note)` takes the server down and calls `note(how)` ("stopped" or "released") before it acts, so that
the outage record says how to bring it back even when the stop is cut short; `start(how)` brings it back the
way it went down and waits for health. `server_kind` is the one place that picks the class. The outage
protocol around them (who takes the server down, who restores it) is control.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_text
from dflash_eval.server import engines, foreign, gpu_memory, outage
from dflash_eval.server.http import http_request, port_open, url_port
from dflash_eval.server.processes import (
    group_alive,
    group_members,
    listener,
    process_start_ticks,
)
from dflash_eval.server.runs import current_run, run_alive, same_run
from dflash_eval.server.signals import signals_deferred
from dflash_eval.server.transitions import Transitions

log = logging.getLogger(__name__)

POLL_S = 0.25
LOG_TAIL_CHARS = 3000
KILL_WAIT_S = 10.0  # how long processes get to vanish after SIGKILL (a GPU's teardown takes a moment)


class ServerError(DflashEvalError):
    """The server could not be brought to the requested state; the message says what to look at."""


def log_tail(path: Path) -> str:
    """The end of a log file, for an error message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-LOG_TAIL_CHARS:]


class Server:
    """What every kind shares: health, the wait for it, the hook commands and the server log."""

    kind: ClassVar[str]

    def __init__(self, settings: dict[str, Any], transitions: Transitions) -> None:
        self.settings = settings
        self.base_url: str = settings["base_url"]
        self.log_dir = Path(settings["log_dir"])
        self.server_log = self.log_dir / "server.log"
        self.transitions = transitions

    def is_up(self) -> bool:
        """True when the health endpoint answers 200."""
        status, _ = http_request(
            self.base_url + self.settings["health_path"], timeout=5.0, key_env=self.settings["api_key_env"]
        )
        return status == 200

    def stop(self, note: Callable[[str], None]) -> None:
        """Take the up server down (or free its GPU memory) and wait until it is; `note(how)` first."""
        raise NotImplementedError

    def start(self, how: str | None) -> None:
        """Bring the server up and wait for health; `how` is how dflash-eval took it down, if it did."""
        raise NotImplementedError

    def launched_pid(self) -> int | None:
        """The pid of the server dflash-eval launched, if one runs (only a managed server is launched)."""
        return None

    def stop_launched(self) -> bool:
        """Stop the server dflash-eval launched, unless keep_running; True if one was stopped."""
        return False

    def finish_launched(self) -> bool:
        """End of a run: stop the server dflash-eval launched unless keep_running or another live run launched or
        uses it (that run stops it at its own end); True if one was stopped."""
        return False

    def add_user(self, run: dict | None) -> None:
        """Put workflow run `run` on record as one that fetches from the launched server (only managed)."""

    def launch_facts(self) -> dict | None:
        """The launch on record, for `server status` (only a managed server is launched)."""
        return None

    def stop_leftovers(self) -> None:
        """Stop what is left of a launched server whose own process is gone (nothing for other kinds)."""

    def check_ours(self) -> None:
        """Raise ServerError when the healthy server is one this checkout may not use (only managed checks)."""

    def live_launch(self) -> bool:
        """Whether a server dflash-eval launched still runs, healthy or still starting (only managed)."""
        return False

    def orphan(self) -> str | None:
        """A launched server that a run which is gone left running against keep_running: what it is, or None."""
        return None

    def stop_orphan(self) -> None:
        """Stop what orphan() names."""

    @property
    def stopped_at_end_of_run(self) -> bool:
        """Whether the end of a run stops this server (so restoring it first would be wasted)."""
        return False

    def wait_healthy(self) -> None:
        """Poll the health endpoint until it answers, bounded by health_timeout_s."""
        start = time.monotonic()
        deadline = start + float(self.settings["health_timeout_s"])
        while time.monotonic() < deadline:
            if self.is_up():
                self.transitions.record("healthy", waited_s=round(time.monotonic() - start, 2))
                return
            self._check_still_starting()
            time.sleep(POLL_S)
        raise ServerError(
            f"server at {self.base_url} not healthy ({self.settings['health_path']}) after "
            f"server.health_timeout_s={self.settings['health_timeout_s']} s; {self._where_to_look()}"
        )

    def _check_still_starting(self) -> None:
        """Raise ServerError when the server can no longer come up by waiting."""

    def _where_to_look(self) -> str:
        return f"{self.server_log} ends with:\n{log_tail(self.server_log)}"

    def _run_hook(self, command: str) -> None:
        """Run a stop/start command through the shell, its output appended to the server log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.server_log, "ab") as out:
            out.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} running: {command}\n".encode())
            out.flush()
            rc = subprocess.run(
                command, shell=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False
            ).returncode
        if rc != 0:
            raise ServerError(
                f"`{command}` exited with {rc}; {self.server_log} ends with:\n{log_tail(self.server_log)}"
            )


@dataclass(frozen=True)
class Launch:
    """What `<log_dir>/server.pid` records of a managed launch."""

    pid: int  # the server: the process listening on the port (until it first is healthy, the shell running `command`)
    start_ticks: int | None  # of pid
    pgid: int  # the process group `command` runs in: the shell, the server and all that it starts
    group_start_ticks: int | None  # of the group's leader (the shell), when it was launched
    command: str
    base_url: str
    owner: dict | None = None  # the workflow run that launched it (runs.py), None when launched by hand
    launcher: dict | None = None  # the process that launched it (outage.this_process())
    users: list[dict] = field(default_factory=list)  # other workflow runs that fetch from it (ensure_up)
    variant: str | None = None  # a profile-server setting (e.g. acc-len-4): never the configured server
    env: dict[str, str] = field(default_factory=dict)  # what the variant exports before `command`

    def describe(self) -> str:
        """What this launch is, in words for a message (a variant's switch and launcher named)."""
        if self.variant is None:
            return f"the managed server (pid {self.pid}, process group {self.pgid})"
        exports = " ".join(f"{k}={v}" for k, v in self.env.items())
        by = self.launcher or {}
        state = "running" if by and outage.holder_alive(by) else "gone"
        return (
            f"profile-server's variant {self.variant} (pid {self.pid}, process group {self.pgid}"
            + (
                f", {exports}: a simulated-acceptance server, not the configured one"
                if exports
                else ": the configured command without speculation, not the configured server"
            )
            + f"), launched by profile-server pid {by.get('pid')} ({state}); its command: {self.command}"
        )

    def runs_using(self) -> list[dict]:
        """The workflow runs that launched or use this server (the owner first)."""
        return ([self.owner] if self.owner else []) + [u for u in self.users if not same_run(u, self.owner)]


@dataclass(frozen=True)
class Variant:
    """A profile-server setting launched on the configured server's port and record (server.pid), so that every
    cleanup path (the end-of-run hook, the next run's start, `server status`, `server finish`) sees it."""

    name: str
    env: dict[str, str]


class Managed(Server):
    """dflash-eval launches `command` (through /bin/sh) in a new process group and owns that group: it is
    launched when healthy is needed, and stopped by SIGTERM to the whole group, SIGKILL after stop_grace_s."""

    kind = "managed"

    def __init__(self, settings: dict[str, Any], transitions: Transitions, variant: Variant | None = None) -> None:
        super().__init__(settings, transitions)
        self.pid_file = self.log_dir / "server.pid"  # one record for every server this checkout launches
        self.variant = variant
        if variant is not None:
            self.server_log = self.log_dir / "profile" / variant.name / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def launched(self) -> Launch | None:
        """The launch on record while any process of its group still runs, else None.

        A group id is not reused while the group has members, and a live leader must be the one launched,
        so a group found here is ours (unless its id was reused after it emptied and the new leader died).
        """
        try:
            info = json.loads(self.pid_file.read_text())
            pid = int(info["pid"])
            launch = Launch(
                pid=pid,
                start_ticks=info.get("start_ticks"),
                pgid=int(info.get("pgid", pid)),
                group_start_ticks=info.get("group_start_ticks", info.get("start_ticks")),
                command=str(info.get("command")),
                base_url=str(info.get("base_url")),
                owner=info.get("owner") if isinstance(info.get("owner"), dict) else None,
                launcher=info.get("launcher") if isinstance(info.get("launcher"), dict) else None,
                users=[u for u in info.get("users") or [] if isinstance(u, dict)],
                variant=info.get("variant"),
                env=dict(info.get("env") or {}),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if self._proc is not None:
            self._proc.poll()  # reap our own child if it exited, so it is not mistaken for a live one
        if launch.base_url != self.base_url or not group_alive(launch.pgid):
            return None
        leader = process_start_ticks(launch.pgid)
        if leader is not None and leader != launch.group_start_ticks:
            return None
        return launch

    def launched_pid(self) -> int | None:
        launch = self.launched()
        return launch.pid if launch is not None and self._server_runs(launch) else None

    @staticmethod
    def _server_runs(launch: Launch) -> bool:
        return process_start_ticks(launch.pid) == launch.start_ticks

    def stop(self, note: Callable[[str], None]) -> None:
        launch = self.launched()
        if launch is None:
            raise ServerError(self._not_ours())
        note("stopped")
        self._stop_group(launch)

    @property
    def _variant_name(self) -> str | None:
        return None if self.variant is None else self.variant.name

    def _clear_other(self, launch: Launch) -> None:
        """The record names a launch other than this one (a profile variant, or the configured server while a
        variant is to start): stop it when its launcher is gone, else say who holds the port."""
        if launch.variant is None:
            raise ServerError(
                f"{self.base_url}: {launch.describe()} is on record in {self.pid_file}; a profile "
                "variant starts only while the configured server is paused (profile-server pauses it)"
            )
        if (
            launch.launcher is not None
            and outage.holder_alive(launch.launcher)
            and not same_run(launch.launcher, outage.this_process())
        ):
            raise ServerError(
                f"the port of {self.base_url} is held by {launch.describe()}: profile-server is "
                "measuring with it, and brings the configured server back when it ends; wait for it"
            )
        self._stop_group(
            launch,
            reason=f"{launch.variant} left running by profile-server pid "
            f"{(launch.launcher or {}).get('pid')}, which is gone",
            variant=launch.variant,
        )

    def start(self, how: str | None) -> None:
        launch = self.launched()
        if launch is not None and launch.variant != self._variant_name:
            self._clear_other(launch)
        if self.is_up():
            self.check_ours()
            return
        self.transitions.record("start_requested")
        launch = self.launched()
        if launch is not None and (how is not None or not self._server_runs(launch)):
            self._stop_group(launch, reason="an interrupted stop" if how is not None else "its server process is gone")
            launch = None
        if launch is None:
            self._launch()
        # else: our server is still starting (launched by an earlier call or process); just wait.
        self.wait_healthy()
        self._record_server_pid()

    def check_ours(self) -> None:
        """A managed server is the one this checkout launched (its server.pid), never another's on the same port,
        and never a profile variant (a simulated acceptance length) taken for the configured server."""
        launch = self.launched()
        if launch is None:
            raise ServerError(self._not_ours())
        if launch.variant != self._variant_name:
            gone = launch.launcher is None or not outage.holder_alive(launch.launcher)
            raise ServerError(
                f"the server at {self.base_url} is {launch.describe()}, not "
                + ("the configured server" if self.variant is None else f"variant {self.variant.name}")
                + ". "
                + (
                    "Its launcher is gone: `dflash-eval server finish --config config.yaml` stops it, and so does the "
                    "next workflow run's start"
                    if gone
                    else "profile-server brings the configured server back when it ends: wait for it"
                )
            )

    def add_user(self, run: dict | None) -> None:
        launch = self.launched()
        if run is None or launch is None or any(same_run(run, r) for r in launch.runs_using()):
            return
        self._write(replace(launch, users=[u for u in launch.users if run_alive(u)] + [run]))

    def _not_ours(self) -> str:
        who, fix = foreign.whose(url_port(self.base_url), self.log_dir)
        return (
            f"the server at {self.base_url} is up, but this checkout did not launch it ({self.pid_file} names no "
            f"live launch): it is {who}. A managed server must be this checkout's own: another's may serve "
            f"another model, and it goes down when its own run ends or extracts. Give this checkout a port of "
            f"its own (server.base_url and the port in server.command), or {fix} and rerun; a server you keep "
            "running yourself belongs under server.kind: external"
        )

    def stop_launched(self) -> bool:
        launch = self.launched()
        if launch is None:
            return False
        if self.settings["keep_running"]:
            log.info("server %s (pid %d) left running: keep_running is set", self.base_url, launch.pid)
            return False
        self._stop_group(launch, reason="stop-launched")
        return True

    def finish_launched(self) -> bool:
        launch = self.launched()
        if launch is None:
            return False
        if launch.variant is not None:  # whatever keep_running says: a variant never outlives its profile-server
            if (
                launch.launcher is not None
                and outage.holder_alive(launch.launcher)
                and not same_run(launch.launcher, outage.this_process())
            ):
                log.info("%s left running: profile-server still measures with it", launch.describe())
                return False
            self._stop_group(
                launch, reason=f"end of run: {launch.variant} outlived its profile-server", variant=launch.variant
            )
            return True
        if self.settings["keep_running"]:
            log.info("server %s (pid %d) left running: keep_running is set", self.base_url, launch.pid)
            return False
        me = current_run()
        others = [r for r in launch.runs_using() if not same_run(r, me) and run_alive(r)]
        if others:  # their fetch would fail mid-request: the last run out stops it (the owner's end hands it on)
            users = [u for u in launch.users if not same_run(u, me)]
            owner = users.pop(0) if same_run(launch.owner, me) and users else launch.owner
            self._write(replace(launch, owner=owner, users=users))
            pids = ", ".join(str(r.get("pid")) for r in others)
            log.warning(
                "server %s (pid %d) left running: workflow run %s, still running, launched or uses it and "
                "stops it at its own end",
                self.base_url,
                launch.pid,
                pids,
            )
            self.transitions.record(
                "kept",
                pid=launch.pid,
                runs=[r.get("pid") for r in others],
                reason="another live run launched or uses it",
            )
            return False
        self._stop_group(launch, reason="end of run")
        return True

    def stop_leftovers(self) -> None:
        """A server killed by hand can leave processes of its group behind (workers holding the GPU)."""
        launch = self.launched()
        if launch is not None and not self._server_runs(launch):
            self._stop_group(launch, reason="its server process is gone")

    def live_launch(self) -> bool:
        return self.launched() is not None

    def _orphan_launch(self) -> Launch | None:
        launch = self.launched()
        if launch is None:
            return None
        if launch.variant is not None:  # left by a profile-server that died (SIGKILL skips its `finally`)
            return launch if launch.launcher is None or not outage.holder_alive(launch.launcher) else None
        if launch.owner is None or self.settings["keep_running"]:
            return None
        me = current_run()
        if any(same_run(r, me) or run_alive(r) for r in launch.runs_using()):
            return None
        return launch

    def orphan(self) -> str | None:
        launch = self._orphan_launch()
        if launch is None:
            return None
        if launch.variant is not None:
            return f"{launch.describe()}, still running at {self.base_url} after its launcher died"
        return (
            f"the managed server at {self.base_url} (pid {launch.pid}, process group {launch.pgid}) that run "
            f"{launch.owner['pid']} launched is still running, and that run is gone without its end-of-run "
            "hook (`dflash-eval server finish`)"
        )

    def stop_orphan(self) -> None:
        launch = self._orphan_launch()
        if launch is None:
            return
        if launch.variant is not None:
            self._stop_group(
                launch,
                reason=f"{launch.variant} left running by profile-server pid "
                f"{(launch.launcher or {}).get('pid')}, which is gone",
                variant=launch.variant,
            )
        else:
            self._stop_group(launch, reason=f"left running by run {launch.owner['pid']}, which is gone")

    def launch_facts(self) -> dict | None:
        """The launch on record, for `server status`: its pid, variant, owner and users, and whether they run."""
        launch = self.launched()
        if launch is None:
            return None
        return {
            "pid": launch.pid,
            "pgid": launch.pgid,
            "variant": launch.variant,
            "env": launch.env,
            "launcher": launch.launcher and {**launch.launcher, "alive": outage.holder_alive(launch.launcher)},
            "runs": [{**r, "alive": run_alive(r)} for r in launch.runs_using()],
            "command": launch.command,
        }

    @property
    def stopped_at_end_of_run(self) -> bool:
        return not self.settings["keep_running"]

    def _check_still_starting(self) -> None:
        if (self._proc is not None and self._proc.poll() is not None) or self.launched() is None:
            raise ServerError(
                f"the managed server exited before it became healthy; {self.server_log} ends with:\n"
                + log_tail(self.server_log)
            )

    def _launch(self) -> None:
        if port_open(self.base_url):
            raise ServerError(
                f"port of {self.base_url} is in use by something that is not a healthy server "
                f"({self.settings['health_path']} does not answer 200) and that dflash-eval did not launch; "
                "stop it or choose another port"
            )
        self.server_log.parent.mkdir(parents=True, exist_ok=True)
        command = self.settings["command"]
        # Ctrl-C or SIGTERM between the fork and the record would leave a server that no server.pid names (issue
        # 32): they wait until it is written. The child starts with the default handlers (exec resets caught signals).
        with signals_deferred("launching the managed server"), open(self.server_log, "ab") as out:
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
            ticks = process_start_ticks(pid)
            self._write(
                Launch(
                    pid=pid,
                    start_ticks=ticks,
                    pgid=pid,
                    group_start_ticks=ticks,
                    command=command,
                    base_url=self.base_url,
                    owner=current_run(),
                    launcher=outage.this_process(),
                    variant=self._variant_name,
                    env=dict(self.variant.env) if self.variant else {},
                )
            )
            self.transitions.record(
                "launched", pid=pid, command=command, **({"variant": self._variant_name} if self.variant else {})
            )

    def _record_server_pid(self) -> None:
        """Once healthy, put the process that serves the port on record instead of the shell around it
        (the pid a user kills; the group stays what dflash-eval stops)."""
        launch = self.launched()
        if launch is None:
            return
        server = listener(url_port(self.base_url), group_members(launch.pgid))
        if server is not None and server != launch.pid:
            self._write(replace(launch, pid=server, start_ticks=process_start_ticks(server)))

    def _write(self, launch: Launch) -> None:
        atomic_write_text(self.pid_file, json.dumps(asdict(launch)))

    def _stop_group(self, launch: Launch, **details: Any) -> None:
        """SIGTERM every process of the launch's group, SIGKILL them after stop_grace_s, then wait for the port
        to close; recorded before and after."""
        by_run = current_run()
        self.transitions.record(
            "stop_requested",
            pid=launch.pid,
            by_command=argv_text(),
            by_run=None if by_run is None else by_run.get("pid"),
            **details,
        )
        grace = float(self.settings["stop_grace_s"])
        _signal_group(launch.pgid, signal.SIGTERM)
        if not self._wait_group_gone(launch.pgid, grace):
            log.warning(
                "server %s (process group %d) ignored SIGTERM for %.0f s: sending SIGKILL",
                self.base_url,
                launch.pgid,
                grace,
            )
            _signal_group(launch.pgid, signal.SIGKILL)
            if not self._wait_group_gone(launch.pgid, KILL_WAIT_S):
                log.warning(
                    "processes %s of server %s outlived SIGKILL by %.0f s",
                    group_members(launch.pgid),
                    self.base_url,
                    KILL_WAIT_S,
                )
        self.pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + 10.0
        while port_open(self.base_url) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.transitions.record("down", pid=launch.pid)

    def _wait_group_gone(self, pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None:
                self._proc.poll()  # reaps our own child, so it leaves no zombie
            if not group_alive(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S / 2)


def argv_text() -> str:
    """This process's command line (what stopped a server, in the transitions log), JSON arguments elided."""
    words = [Path(sys.argv[0]).name] + [
        "JSON" if before in ("--settings", "--runtime") else word for before, word in zip(sys.argv, sys.argv[1:])
    ]
    return " ".join(words)[:300]


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


class External(Server):
    """Someone else owns the server (systemd, docker, another host): its commands stop and start it."""

    kind = "external"

    def stop(self, note: Callable[[str], None]) -> None:
        note("stopped")
        self._stop_by_command()

    def start(self, how: str | None) -> None:
        if self.is_up():
            return
        self.transitions.record("start_requested")
        self._run_hook(self.settings["start_command"])
        self.wait_healthy()

    def _stop_by_command(self, **details: Any) -> None:
        self.transitions.record("stop_requested", **details)
        self._run_hook(self.settings["stop_command"])
        timeout = float(self.settings["stop_grace_s"]) + 30.0
        deadline = time.monotonic() + timeout
        while self.is_up():
            if time.monotonic() > deadline:
                raise ServerError(
                    f"server at {self.base_url} still healthy {timeout:.0f} s after "
                    f"server.stop_command `{self.settings['stop_command']}`; see {self.server_log}"
                )
            time.sleep(POLL_S)
        self.transitions.record("down")


class Release(External):
    """The server keeps running and releases its GPU memory (the engine's calls, server.engines: SGLang's
    /release_memory_occupation, vLLM's /sleep?level=1), checked by the GPU memory in use; stop_command and
    start_command, when set, take over where the memory does not drop."""

    kind = "release"

    def __init__(self, settings: dict[str, Any], transitions: Transitions) -> None:
        super().__init__(settings, transitions)
        self._calls: engines.MemoryCalls | None = None

    @property
    def calls(self) -> engines.MemoryCalls:
        """The engine's memory calls (server.engine, or asked of the server once for auto)."""
        if self._calls is None:
            self._calls = engines.memory_calls(self.settings)
        return self._calls

    def stop(self, note: Callable[[str], None]) -> None:
        before = self._read_gpu_memory()  # a broken probe fails here, before anything changed
        calls = self.calls
        if calls.sleeping is not None and self._asleep(calls) is None:  # no sleep routes: fail before anything changed
            raise ServerError(
                f"GET {self.base_url}{calls.sleeping} did not answer, so the server cannot sleep: {calls.needs}"
            )
        note("released")
        action = calls.release.lstrip("/")
        self.transitions.record("stop_requested", action=action, engine=calls.engine)
        self._post(calls.release)
        if self._memory_dropped(before):
            self.transitions.record("down", action=action, engine=calls.engine)
            return
        if not self.settings["stop_command"]:
            raise ServerError(
                f"POST {self.base_url}{calls.release} answered 200 but the GPU memory in use did not drop "
                f"by server.release_min_drop_gib={self.settings['release_min_drop_gib']} GiB (see memory_check in "
                f"{self.transitions.path}): {calls.needs}, or set "
                "server.stop_command and server.start_command as a fallback (release_min_drop_gib: 0 skips the check)"
            )
        note("stopped")
        self._stop_by_command(reason="release did not free the GPU memory")

    def start(self, how: str | None) -> None:
        if how == "released":
            calls = self.calls
            self.transitions.record("start_requested", action=calls.resume.lstrip("/"), engine=calls.engine)
            self._post(calls.resume)
            self.wait_healthy()
            self._check_awake(calls)
        elif self.settings["start_command"]:
            super().start(how)
        elif not self.is_up():
            self.wait_healthy()

    def _check_awake(self, calls: engines.MemoryCalls) -> None:
        """For an engine that says whether it sleeps (vLLM's /is_sleeping, healthy while asleep): that it woke."""
        if calls.sleeping is not None and self._asleep(calls) is not False:
            raise ServerError(
                f"POST {self.base_url}{calls.resume} answered 200 but GET {self.base_url}{calls.sleeping} "
                "does not say awake"
            )

    def _asleep(self, calls: engines.MemoryCalls) -> bool | None:
        """What `calls.sleeping` answers ({"is_sleeping": bool}), None when it does not answer so."""
        status, body = http_request(
            self.base_url + str(calls.sleeping), timeout=30.0, key_env=self.settings["api_key_env"]
        )
        try:
            value = json.loads(body).get("is_sleeping") if status == 200 else None
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    def _where_to_look(self) -> str:
        if self.settings["start_command"]:
            return super()._where_to_look()
        return "a release-kind server without start_command is started by you, not by dflash-eval"

    def _read_gpu_memory(self) -> gpu_memory.Reading:
        probe = self.settings["memory_probe"]
        reading = gpu_memory.used_mib(probe)
        if probe and reading.mib is None:
            raise ServerError(
                f"server.memory_probe: {reading.source}; it must print the used GPU memory in MiB "
                "(one number per GPU), or set it to null to read it from the NVIDIA driver"
            )
        return reading

    def _memory_dropped(self, before: gpu_memory.Reading) -> bool:
        """Whether the GPU memory in use fell by release_min_drop_gib within release_check_s; True when it
        cannot be read (logged as unchecked), since then only the extraction itself can tell."""
        needed = float(self.settings["release_min_drop_gib"]) * 1024
        if needed <= 0 or before.mib is None:
            reason = "server.release_min_drop_gib is 0" if needed <= 0 else before.source
            self.transitions.record("memory_check", checked=False, reason=f"GPU memory could not be checked: {reason}")
            return True
        deadline = time.monotonic() + float(self.settings["release_check_s"])
        while True:
            after = self._read_gpu_memory()
            dropped = after.mib is not None and before.mib - after.mib >= needed
            if dropped or time.monotonic() >= deadline:
                self.transitions.record(
                    "memory_check",
                    checked=True,
                    freed=dropped,
                    before_mib=before.mib,
                    after_mib=after.mib,
                    needed_mib=needed,
                    source=before.source,
                )
                return dropped
            time.sleep(2 * POLL_S)

    def _post(self, path: str) -> None:
        status, body = http_request(
            self.base_url + path, method="POST", timeout=300.0, key_env=self.settings["api_key_env"]
        )
        if status != 200:
            raise ServerError(
                f"POST {self.base_url}{path} answered {status or 'nothing'}: {body[:500]!r} ({self.calls.needs})"
            )


KIND_CLASSES: dict[str, type[Server]] = {cls.kind: cls for cls in (Managed, External, Release)}


def server_kind(settings: dict[str, Any], transitions: Transitions) -> Server:
    """The Server of `settings["kind"]` (settings already resolved by config.stage_settings)."""
    return KIND_CLASSES[settings["kind"]](settings, transitions)
