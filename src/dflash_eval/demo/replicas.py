"""The demo server's data-parallel replicas (`--dp-size N`, SGLang's flag): N worker processes, each with its own
copy of the target and drafter, each answering one request at a time, so N requests are served at once.

A replica computes exactly what the single-process server computes (the same models, the same thread count), so
a completion and its counters do not depend on which replica answered it or on how many there are. Timings are
`time.perf_counter` readings, which on Linux come from one system-wide monotonic clock: the front's arrival time
and a replica's start and finish times are comparable.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

_engine: Any = None  # the replica's own engine (demo.server.Engine), in each worker process


def _exit_with_parent(parent: int) -> None:
    """End this replica when the server that started it is gone (killed without a chance to stop its pool)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _load(make_engine: Callable[[argparse.Namespace], Any], args: argparse.Namespace, parent: int, loaded: Any) -> None:
    global _engine
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _engine = make_engine(args)
    loaded.wait()  # every replica loaded before the server answers /health


def _generate(
    prompt_ids: list[int], max_new_tokens: int, drawn: dict[str, Any] | None, ignore_eos: bool, seed: int
) -> tuple[list[int], dict[str, Any] | None, list[int], tuple[float, float | None, float]]:
    assert _engine is not None
    completion, spec, clock = _engine.generate_timed(prompt_ids, max_new_tokens, drawn, ignore_eos, seed)
    return completion, spec, _engine.last_steps, clock


def _ready() -> int:
    return os.getpid()


class Replicas:
    """`size` replicas of the engine, loaded before the constructor returns; `generate` blocks until one is free."""

    def __init__(self, make_engine: Callable[[argparse.Namespace], Any], args: argparse.Namespace, size: int) -> None:
        """`make_engine(args)` builds a replica's engine in its worker process (a module-level function: it is
        pickled by name)."""
        context = multiprocessing.get_context("spawn")
        loaded = context.Barrier(size)
        self.pool = ProcessPoolExecutor(
            size, context, initializer=_load, initargs=(make_engine, args, os.getpid(), loaded)
        )
        for future in [self.pool.submit(_ready) for _ in range(size)]:
            future.result()  # each replica's initializer waits for all: none answers before every one loaded
        self.size = size

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, drawn: dict[str, Any] | None, ignore_eos: bool, seed: int
    ) -> tuple[list[int], dict[str, Any] | None, list[int], tuple[float, float | None, float]]:
        """A replica's completion, counters, verification steps and (started, first token, finished) clock."""
        return self.pool.submit(_generate, prompt_ids, max_new_tokens, drawn, ignore_eos, seed).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
