"""SIGTERM inside an asyncio event loop (fetch's requests): the loop's own handler, since asyncio swallows an
exception that a Python signal handler raises while one of its callbacks runs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from dflash_eval.errors import Terminated
from dflash_eval.server.signals import sigterm_cancels, sigterm_raises


async def _signalled_in_a_callback(sleep_s: float) -> str:
    """SIGTERM sent from inside a plain loop callback (not a task step): the handler runs inside that callback."""
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    await asyncio.sleep(sleep_s)
    return "finished"


def test_a_handler_that_raises_loses_the_signal_inside_a_loop_callback(caplog):
    """Why fetch does not rely on sigterm_raises alone: asyncio's Handle._run catches the Terminated the handler
    raises inside its callback, logs it, and the work runs on to the end (the lost SIGTERM of the fetch test)."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    with sigterm_raises():
        assert asyncio.run(_signalled_in_a_callback(0.3)) == "finished"
    assert any("Terminated" in r.getMessage() + str(r.exc_info) for r in caplog.records)


def test_the_loops_own_handler_cancels_the_work_and_raises_terminated():
    finished_cleanup = []

    async def work() -> str:
        try:
            return await _signalled_in_a_callback(10)
        finally:
            finished_cleanup.append(True)  # cancellation runs the work's finally blocks

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_raises() as guard:
        started = time.monotonic()
        with pytest.raises(Terminated, match="SIGTERM"):
            asyncio.run(sigterm_cancels(work(), guard))
        assert time.monotonic() - started < 5 and finished_cleanup == [True]
        assert guard.mode == "cleanup"  # a second SIGTERM only logs, as sigterm_raises leaves it
        assert signal.getsignal(signal.SIGTERM) == guard.handle  # sigterm_raises' handler is back after the loop
    assert signal.getsignal(signal.SIGTERM) == before


def test_work_without_a_signal_returns_its_value_and_restores_the_handler():
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    with sigterm_raises() as guard:
        assert asyncio.run(sigterm_cancels(work(), guard)) == 7
        assert guard.mode == "raise" and signal.getsignal(signal.SIGTERM) == guard.handle
