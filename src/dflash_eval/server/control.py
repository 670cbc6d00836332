"""The outage protocol around the inference server that fetch reads from and extract must pause.

How each kind of server goes down and comes back (managed, external, release) is kinds.py's. Here:
extraction jobs share one outage (see outage.py): the first takes the server down, later ones join,
extractions run one at a time, and the last one out brings the server back, once; fetch waits while an
outage is held; the end of a run restores what a dead job left down and stops what the run launched.
Every transition is logged with its time to ``log_dir/transitions.jsonl`` (transitions.py), so that a run
that left the server down can be diagnosed afterwards, and the report can show how long it was away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_eval.config import server_settings, settings_from_args, stage_settings
from dflash_eval.server import outage
from dflash_eval.server.kinds import POLL_S, ServerError, server_kind
from dflash_eval.server.lock import host_lock
from dflash_eval.server.outage import Outage
from dflash_eval.server.runs import current_run
from dflash_eval.server.signals import signals_deferred, sigterm_raises
from dflash_eval.server.transitions import Transitions

log = logging.getLogger(__name__)

WAIT_LOG_S = 60.0  # how often a job waiting for another job's outage says so
PORT_WORK = "profile"  # server_paused's work that needs the server's port (profile-server's variants), not its GPU
UP_COMMAND = "dflash-eval server up --config config.yaml"


class ServerController:
    """The server of one settings dict, taken down and brought back through the host-wide outage record;
    every method is safe to repeat."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = stage_settings("server", settings)
        self.kind: str = self.settings["kind"]
        self.base_url: str = self.settings["base_url"]
        self.log_dir = Path(self.settings["log_dir"])
        self.lock_file = self.log_dir / "server.lock"  # held for each transition (short)
        self.gpu_lock_file = self.log_dir / "extract.lock"  # held for each extraction (long)
        self.outage_file = self.log_dir / "outage.json"
        self.transitions = Transitions(self.log_dir, self.kind, self.base_url)
        self.server = server_kind(self.settings, self.transitions)

    # ----- state -----

    def is_healthy(self) -> bool:
        """True when the health endpoint answers 200."""
        return self.server.is_up()

    def launched_pid(self) -> int | None:
        """The pid of the managed server this workflow launched, if it still runs."""
        return self.server.launched_pid()

    def current_outage(self) -> Outage | None:
        """The outage dflash-eval holds now (dead holders pruned), or None."""
        return outage.load(self.outage_file)

    def record(self, event: str, **extra: Any) -> None:
        """Append one transition to transitions.jsonl and to the Python log."""
        self.transitions.record(event, **extra)

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
            if len(current.holders) == 1:
                self._take_down_again(current)

    def _take_down_again(self, current: Outage) -> None:
        """An outage that no live job held is only joined once the server really is down: a restore cut short
        (a second Ctrl-C) can leave it recorded while the server it relaunched runs, holding the GPU."""
        if not (self.server.live_launch() or self.is_healthy()):
            return
        log.warning(
            "server %s is up although %s records an outage that no live job held: taking it down again",
            self.base_url,
            self.outage_file,
        )
        self.record("stale_outage", since=current.since, action="taken down again")

        def note(how: str) -> None:
            current.how = how
            outage.save(self.outage_file, current)

        self.server.stop(note)

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
            self.server.stop_leftovers()  # a down server stays down, but what is left of it must not hold the GPU
            return

        def note(how: str) -> None:  # how the server is about to go down, recorded before it does
            current.how = how
            outage.save(self.outage_file, current)

        try:
            self.server.stop(note)
        except BaseException:
            if current.how is None:  # failed before anything was stopped: there is no outage to remember
                outage.clear(self.outage_file)
                self.record("resume", restored=True, reason="the stop failed before anything was stopped")
            raise

    def _end_outage(self, current: Outage) -> None:
        """Bring the server back if it was up before the outage, then forget the outage."""
        if current.was_up:
            try:
                self.server.start(current.how)
            except ServerError as error:  # the outage stays recorded, so the next server need retries the restore
                with signals_deferred("recording the failed restore"):
                    current.restore_error = str(error).splitlines()[0][:500]
                    outage.save(self.outage_file, current)
                    self.record("restore_failed", error=current.restore_error)
                raise ServerError(f"{error}\n{self.restore_advice()}") from error
        with signals_deferred(
            "ending the outage record"
        ):  # a server up with its outage still open misleads the next job
            outage.clear(self.outage_file)
            self.record("resume", restored=current.was_up)

    def restore_advice(self) -> str:
        """After a failed restore: what is on disk and what retries it (true of what the end-of-run hook does)."""
        text = (
            f"The server {self.base_url} ({self.kind}) is down; its log is {self.server.server_log}, and "
            f"{self.outage_file} keeps the outage (restore_error says why the restore failed). "
            f"`{UP_COMMAND}` retries the restore now; the next fetch or extraction retries it too"
        )
        if self.server.stopped_at_end_of_run:
            return text + (
                ". The end-of-run hook (`dflash-eval server finish`) does not: a launched server is not "
                "kept after a run (keep_running: false), so it deletes that record instead."
            )
        return text + ", and so does the end-of-run hook (`dflash-eval server finish`)."

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
                self.server.check_ours()  # managed: this checkout's own launch, not another's on the same port
                self._use()
                return  # the common case: nothing to restore, nothing to wait for
            with host_lock(self.lock_file):
                current = self.current_outage()
                if current is None or not current.holders:
                    if current is not None:
                        self._end_outage(current)
                    self.server.start(None)
                    self._use()
                    return
            waited = time.monotonic() - started
            if waited > float(self.settings["outage_wait_s"]):
                raise ServerError(
                    f"server {self.base_url} has been held down for {waited:.0f} s (server.outage_wait_s="
                    f"{self.settings['outage_wait_s']}) by the extraction of {current.holders} (recorded in "
                    f"{self.outage_file}); wait for that job, raise server.outage_wait_s, or end a stuck one "
                    "(its restore runs in `finally`; `dflash-eval server finish` restores what it left down)"
                )
            if time.monotonic() - announced > WAIT_LOG_S:
                log.info("server %s is held down by %s for their extraction: waiting", self.base_url, current.holders)
                announced = time.monotonic()
            time.sleep(4 * POLL_S)

    def _use(self) -> None:
        """Put this workflow run on the launch's record as a user, so that another run's end does not stop the
        server under its fetch."""
        run = current_run()
        if run is not None:
            with host_lock(self.lock_file):
                self.server.add_user(run)

    def went_down_since(self, unix: float) -> str:
        """Who stopped the server since `unix` (from transitions.jsonl), in words for a failed fetch; "" if none."""
        try:
            lines = self.transitions.path.read_text().splitlines()
        except OSError:
            return ""
        stops = []
        for line in lines:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("event") == "stop_requested" and float(entry.get("unix", 0)) >= unix:
                    stops.append(entry)
        if not stops:
            return ""
        last = stops[-1]
        run = f" of workflow run {last['by_run']}" if last.get("by_run") else ""
        return (
            f"; the server was stopped meanwhile, at {last.get('time')}, by pid {last.get('by_pid')}{run} "
            f"(`{last.get('by_command') or '?'}`: {last.get('reason') or 'an outage'}; see {self.transitions.path})"
        )

    # ----- end of run -----

    def stop_if_launched(self) -> bool:
        """Stop the managed server that dflash-eval launched, unless keep_running; True if one was stopped."""
        return self.server.stop_launched()

    def finish(self) -> None:
        """End of a run (Snakemake's onsuccess/onerror): restore what a job that died left down, then stop
        the server the run launched unless keep_running or another live run launched or uses it (Managed's
        finish_launched). Idempotent; leaves live outages to their holders."""
        with host_lock(self.lock_file):
            current = self.current_outage()
            if current is not None and current.holders:
                log.info("server %s is still held down by %s: they will restore it", self.base_url, current.holders)
                return
            if current is not None:
                if self.server.stopped_at_end_of_run:
                    if current.restore_error:
                        log.warning(
                            "server %s did not come back after an extraction of this run (%s; see %s); "
                            "a launched server is not kept after a run, so it is not launched again now: "
                            "`%s` launches it",
                            self.base_url,
                            current.restore_error,
                            self.server.server_log,
                            UP_COMMAND,
                        )
                    outage.clear(self.outage_file)  # the run ends and would stop it again at once
                    self.record("resume", restored=False, reason="end of run: a launched server is not kept")
                else:
                    self._end_outage(current)
        self.server.finish_launched()

    def reclaim(self, act: bool = True) -> str | None:
        """At the start of a workflow run (the Snakefile, when it loads): end what a run that died without its
        end-of-run hook left behind, and say so in one line (None when there was nothing).

        An outage that no live job holds is ended as `finish` would (a managed server that the run would stop
        is not restored, only forgotten: the run's fetch launches it when it needs it), and a managed server
        that a run which is gone launched (and would have stopped) is stopped. With act False (a dry run) only
        say what a real run would do.
        """
        with host_lock(self.lock_file):
            found, done, orphan_found, orphan_done = [], [], [], []
            current = self.current_outage()
            if not (current is not None and current.holders):  # never under a live outage: the server is down
                orphan = self.server.orphan()  # first: a variant left on the port would pass for the restored server
                if orphan is not None:
                    orphan_found.append(orphan)
                    if act:
                        self.server.stop_orphan()
                        orphan_done.append("stopped that server with its process group")
            if current is not None and not current.holders:
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(current.since))
                found.append(f"an outage that no live job holds (recorded in {self.outage_file} since {since})")
                if act:
                    if self.server.stopped_at_end_of_run or not current.was_up:
                        outage.clear(self.outage_file)
                        self.record("resume", restored=False, reason="start of run: no live holder")
                        done.append(
                            "forgot the outage (the server is launched again when a fetch needs it)"
                            if current.was_up
                            else "ended the outage (the server was down before it)"
                        )
                    else:
                        try:
                            self._end_outage(current)
                            done.append("restored the server and ended the outage")
                        except ServerError as error:
                            done.append(
                                f"could not restore the server ({str(error).splitlines()[0][:300]}); the "
                                f"record stays, and `{UP_COMMAND}` retries"
                            )
        found, done = found + orphan_found, done + orphan_done
        if not found:
            return None
        if not act:
            return f"dflash-eval: found {' and '.join(found)}; a run that is not a dry run ends it."
        return f"dflash-eval: found {' and '.join(found)}: {'; '.join(done)}."


# ----- pausing around extraction -----


@contextlib.contextmanager
def server_paused(settings: dict[str, Any], work: str = "extraction") -> Iterator[ServerController]:
    """Free the server's GPU for the block, and bring the server back after it if it was up.

    Jobs that pause at the same time share one outage: the server goes down once, their blocks run
    one at a time (the GPU lock), and it comes back once, after the last. Restores also on
    exceptions, Ctrl-C and SIGTERM.

    The restore is shielded: from the moment it begins, SIGINT and SIGTERM are only logged, so that a second
    Ctrl-C (or Snakemake's SIGTERM) cannot leave a relaunched server that no record names or an outage record
    that says the server is down while it runs. A SIGINT or SIGTERM while the server is being taken
    down waits until it is down, then interrupts the block.

    A restore that fails after the block succeeded does not fail the block: what the block made is complete
    (the extraction publishes and keeps its cache inside it), and failing the job would only make Snakemake
    delete it. The failure is logged as an error naming the server, its log and the command that retries it
    (ServerController.restore_advice), recorded as `restore_failed` in transitions.jsonl and as restore_error
    in outage.json, and the outage stays recorded, so the next server need (a fetch, an extraction, `server
    up`) retries the restore, and the end-of-run hook retries it or, for a launched server that the run stops
    anyway, says that it did not come back. A restore that fails after a failed block raises (the job fails
    either way), its message saying the same.
    `work` names the block in transitions.jsonl (`<work>_start`, `<work>_end`): "extraction", or "profile" for
    profile-server, so that the report's outage table counts each for what it was.

    A server that does not share the target's GPU (`server.shares_target_gpu: false`: on the CPU or other GPUs) is
    left serving around an extraction (or profile_target's timing, also "extraction" here): nothing is paused,
    recorded or locked, so fetches go on beside the block. profile-server's block ("profile") pauses it wherever it
    runs: its variants are launched on the server's port.
    """
    ctl = ServerController(settings)
    if work != PORT_WORK and not ctl.settings["shares_target_gpu"]:
        log.info(
            "server %s does not share the target's GPU (server.shares_target_gpu: false): it keeps serving during "
            "the %s",
            ctl.base_url,
            work,
        )
        yield ctl
        return
    block_ok = False
    with sigterm_raises(sigint=True) as guard:
        try:
            with guard.deferred():
                ctl.join_outage()
            with host_lock(ctl.gpu_lock_file):  # one extraction at a time; the server stays down between them
                ctl.record(f"{work}_start")
                try:
                    yield ctl
                except BaseException as error:
                    ctl.record(f"{work}_end", ok=False, error=type(error).__name__)
                    raise
                ctl.record(f"{work}_end", ok=True)
                block_ok = True
        finally:
            guard.cleanup()
            try:
                ctl.leave_outage()
            except ServerError as error:
                if not block_ok:
                    raise
                log.error(
                    "the extraction finished and its outputs are complete, but the server did not come "
                    "back after it: %s",
                    error,
                )


# ----- CLI -----


ACTIONS = {
    "up": "make the server healthy: end an outage that no live job holds (bringing the server back the way it "
    "went down), then launch it (managed), run start_command (external) or wait for it; while an "
    "extraction holds it down, wait for that job (at most outage_wait_s)",
    "down": "take the server down (stop it, or release its GPU memory) until `up` or `finish` brings it back",
    "status": "print the state as JSON (base_url, kind, healthy, launched_pid, launch, outage); exits 0 when the server "
    "is healthy, 3 when it is not (as systemctl does)",
    "stop-launched": "stop the managed server that dflash-eval launched, with its whole process group, unless "
    "keep_running; a server it did not launch is left alone",
    "finish": "the end-of-run hook (the Snakefile's onsuccess/onerror): restore what a job that died left down, "
    "then stop the server this run launched, unless keep_running or another live run launched or uses "
    "it (a profile variant whose launcher is gone always)",
}
EXIT_STATUS = (
    "exit status: 0 done (status: healthy); 2 the settings are wrong or the server did not reach the "
    "state (the message says why); 3 from status: the server is not healthy"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-eval server {up,down,status,stop-launched,finish} --settings JSON | --config config.yaml`."""
    width = max(map(len, ACTIONS)) + 2
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = "actions:\n" + "\n".join(
        textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
        for name, text in ACTIONS.items()
    )
    parser.epilog = textwrap.fill(EXIT_STATUS, 100)
    parser.add_argument("action", choices=list(ACTIONS), help="what to do (see actions above)")
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
    status = {
        "base_url": ctl.base_url,
        "kind": ctl.kind,
        "healthy": healthy,
        "launched_pid": ctl.launched_pid(),
        "launch": ctl.server.launch_facts(),
        "outage": None if current is None else vars(current),
    }
    print(json.dumps(status))
    return 0 if healthy else 3
