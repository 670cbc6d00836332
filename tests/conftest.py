"""Shared test setup: tiny models run single-threaded.

The test models are far too small to gain from intra-op threads, and OpenMP worker threads that
spin on a busy 2-core machine can stall a forward for minutes.
"""

import gc
import os

import pytest
import torch

pytest_plugins = ["tests.support.sglang_source"]  # the sglang_srt fixture, for every test package

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Every CPU forward of a hybrid target in the tests (the references, the demo builders) runs the torch Gated
# DeltaNet path, also where fla imports (a GPU machine with `.[gpu]`): transformers would otherwise bind fla's
# Triton kernels, which refuse CPU tensors. Tests of a backend bind their own with `use_backend`.
from dflash_eval.extract.backends import bind_backend  # noqa: E402

bind_backend("torch", "cpu")

from tests.support.heap import interpreter_frozen_count  # noqa: E402


@pytest.fixture(autouse=True)
def _heap_left_as_found(request):
    """A test that leaves the collector's heap more frozen than it found it fails here, by name: what is frozen
    is never collected, and fetch's heap_frozen (rightly) leaves a heap it finds frozen alone, so a leak would
    surface later, in another test, as that test's failure."""
    before = max(gc.get_freeze_count(), interpreter_frozen_count())
    yield
    after = gc.get_freeze_count()
    if after > before:
        gc.unfreeze()
        pytest.fail(f"{request.node.nodeid} left {after - before} objects frozen (gc.freeze without gc.unfreeze)")


_FROZEN_AT_START: list[int] = []


def pytest_sessionstart(session):
    _FROZEN_AT_START.append(gc.get_freeze_count())
    interpreter_frozen_count()  # measured before any test runs (it unfreezes the heap)


def pytest_terminal_summary(terminalreporter):
    if _FROZEN_AT_START and _FROZEN_AT_START[0]:
        terminalreporter.write_line(
            f"the heap had {_FROZEN_AT_START[0]} frozen objects when the session started "
            "(frozen by what ran before the tests: the interpreter's start, a plugin)"
        )
