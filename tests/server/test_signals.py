"""SIGTERM while an asyncio event loop runs (fetch's requests): asyncio swallows an exception that a Python signal
handler raises inside one of its callbacks, so sigterm_raises cancels the loop's tasks there instead and raises
Terminated as the cancellation leaves its block."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from dflash_eval.errors import Terminated
from dflash_eval.server.signals import sigterm_raises


async def _signalled_in_a_callback(sleep_s: float, cleanup: list[str] | None = None) -> str:
    """SIGTERM sent from inside a plain loop callback (not a task step): the handler runs inside that callback."""
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    try:
        await asyncio.sleep(sleep_s)
        return "finished"
    finally:
        if cleanup is not None:
            cleanup.append("finally ran")


def test_a_handler_that_raises_loses_the_signal_inside_a_loop_callback(caplog):
    """Why: asyncio's Handle._run catches what the handler raises inside its callback and only logs it; the work
    runs on to the end (how fetch lost a SIGTERM before)."""

    def raising(signum, frame):
        raise Terminated("SIGTERM")

    caplog.set_level(logging.ERROR, logger="asyncio")
    previous = signal.signal(signal.SIGTERM, raising)
    try:
        assert asyncio.run(_signalled_in_a_callback(0.3)) == "finished"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert any("Exception in callback" in r.getMessage() for r in caplog.records)


def test_inside_a_loop_the_signal_cancels_its_tasks_and_the_block_raises_terminated(caplog):
    cleanup: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(Terminated, match="SIGTERM"), sigterm_raises() as guard:
        asyncio.run(_signalled_in_a_callback(10, cleanup))
    assert time.monotonic() - started < 5 and cleanup == ["finally ran"]  # cancelled, its finally blocks ran
    assert guard.mode == "cleanup" and guard.cancelled_by == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()]


def test_a_second_signal_during_the_cancellation_only_logs(caplog):
    async def twice() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.sleep(10)

    caplog.set_level(logging.WARNING)
    with pytest.raises(Terminated), sigterm_raises():
        asyncio.run(twice())
    assert any("received again" in r.getMessage() for r in caplog.records)


def test_outside_a_loop_the_handler_raises_at_once_and_a_cancellation_of_its_own_passes():
    with pytest.raises(Terminated), sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    with pytest.raises(asyncio.CancelledError), sigterm_raises():  # not ours: no signal came
        raise asyncio.CancelledError
