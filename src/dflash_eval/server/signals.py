"""SIGTERM (what `scancel` and Snakemake's cancel send) as an exception, so that `finally` blocks restore the
server and flush records; deferred while the server is half-way through a transition."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dflash_eval.errors import Terminated

log = logging.getLogger(__name__)


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
