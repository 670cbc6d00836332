"""SIGTERM (what `scancel` and Snakemake's cancel send) as an exception, so that `finally` blocks restore the
server and flush records; SIGINT and SIGTERM deferred while the server is half-way through a transition, and
only logged once the restore has begun (a second Ctrl-C must not cut a restore short). While an asyncio
event loop runs (fetch's requests) the handler does not raise: an exception raised by a signal handler inside one
of the loop's callbacks is caught and only logged by asyncio (events.Handle._run catches every BaseException but
SystemExit and KeyboardInterrupt), so the signal would be lost. It cancels the loop's tasks instead, at the loop's
next safe point, and the cancellation leaving the block is raised as the signal's exception."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dflash_eval.errors import Terminated

log = logging.getLogger(__name__)

SHIELDED = (signal.SIGINT, signal.SIGTERM)


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class SigtermGuard:
    """What SIGTERM and SIGINT do now: raise (Terminated, KeyboardInterrupt); or, during a server transition,
    wait until the transition is complete (a half-stopped server is harder to restore); or, once cleaning up
    (the restore), only log: the restore and the records it writes must finish, whatever the user presses."""

    def __init__(self) -> None:
        self.mode = "raise"
        self.pending: int | None = None
        self.cancelled_by: int | None = None  # the signal that cancelled a running event loop's tasks

    def handle(self, signum: int, frame: Any) -> None:
        if self.mode == "raise":
            self.mode = "cleanup"
            try:
                loop = asyncio.get_running_loop()  # the loop this (the main) thread is running, if any
            except RuntimeError:
                raise _exception(signum) from None
            self.cancelled_by = signum
            loop.call_soon_threadsafe(_cancel_all, loop)
            return
        if self.mode == "defer":
            self.pending = self.pending or signum
            log.warning(
                "%s received during a server transition: acting on it once the transition is complete", _name(signum)
            )
        else:
            log.warning(
                "%s received again while the server is being restored: finishing the restore first "
                "(at most server.health_timeout_s; `kill -9 %d` abandons it, and the next run or "
                "`dflash-eval server up` ends what it leaves)",
                _name(signum),
                os.getpid(),
            )

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A SIGTERM or SIGINT inside the block is raised at its end."""
        self.mode = "defer"
        try:
            yield
        finally:
            if self.mode == "defer":
                self.mode = "raise"
        if self.pending:
            signum, self.pending = self.pending, None
            self.mode = "cleanup"
            raise _exception(signum, " (received during a server transition)")

    def cleanup(self) -> None:
        """From now on SIGTERM and SIGINT only log: the restore must finish."""
        self.mode = "cleanup"


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _exception(signum: int, note: str = "") -> BaseException:
    return KeyboardInterrupt(f"SIGINT{note}") if signum == signal.SIGINT else Terminated(f"SIGTERM{note}")


@contextlib.contextmanager
def sigterm_raises(sigint: bool = False) -> Iterator[SigtermGuard]:
    """Turn SIGTERM (and with `sigint`, SIGINT) into an exception for the block (see SigtermGuard); restores
    the old handlers."""
    guard = SigtermGuard()
    if threading.current_thread() is not threading.main_thread():
        log.warning("not in the main thread: SIGTERM will not restore the server")
        yield guard
        return
    signums = SHIELDED if sigint else (signal.SIGTERM,)
    previous = {signum: signal.signal(signum, guard.handle) for signum in signums}
    try:
        yield guard
    except asyncio.CancelledError:
        if guard.cancelled_by is None:
            raise
        raise _exception(guard.cancelled_by) from None  # the loop's tasks were cancelled for this signal
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred(what: str) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the end of the block, then act as they would have (the handlers in place
    before it run): for the few lines that launch a server and put it on record, or end an outage's record,
    which an interruption would leave half done (a server running that no record names). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        pending.append(signum)
        log.warning("%s received while %s: acting on it once that is done", _name(signum), what)

    previous = {signum: signal.signal(signum, hold) for signum in SHIELDED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    for signum in dict.fromkeys(pending):
        signal.raise_signal(signum)
