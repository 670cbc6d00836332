"""Which GPU an evaluation runs on: `cuda` takes a free one, and no two evaluations share one.

Snakemake's `gpu` resource caps how many GPU jobs run at once but not which GPU each one takes, so
several evaluations on one machine would all land on cuda:0. Each evaluation therefore holds an
exclusive lock on one file per GPU for as long as it runs (`flock`: the kernel drops it when the
process ends, crash or kill included, so a stale lock cannot exist). `cuda` takes the first GPU whose
lock is free and waits while all are held; `cuda:N` waits for GPU N. Lock files are named by the
GPU's UUID where torch reports one, so jobs with different CUDA_VISIBLE_DEVICES still exclude each
other; they live in $DFLASH_EVAL_GPU_LOCKS (default: <tmp>/dflash-eval-gpus).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch

from dflash_eval.errors import DflashEvalError

log = logging.getLogger(__name__)

_held: list[IO] = []  # the claimed locks, kept open for the life of the process


def lock_dir() -> Path:
    return Path(os.environ.get("DFLASH_EVAL_GPU_LOCKS") or Path(tempfile.gettempdir()) / "dflash-eval-gpus")


def visible_gpus() -> list[str]:
    """An identity per visible CUDA device, in index order: its UUID, else its index."""
    names = []
    for index in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        names.append(f"GPU-{uuid}" if uuid is not None else str(index))
    return names


def _try_lock(path: Path) -> IO | None:
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def claim_device(requested: str, gpus: Sequence[str] | None = None, directory: Path | None = None,
                 poll_s: float = 2.0, timeout_s: float | None = None) -> torch.device:
    """The device to evaluate on; for `cuda` / `cuda:N` a GPU that no other evaluation holds.

    `gpus` (identities, one per visible index) defaults to the visible CUDA devices; tests pass their own.
    """
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    gpus = list(visible_gpus() if gpus is None else gpus)
    if not gpus:
        raise DflashEvalError(f"evaluation.device is {requested!r} but no CUDA device is visible; "
                              "set evaluation.device: cpu or run on a GPU machine")
    if device.index is not None and device.index >= len(gpus):
        raise DflashEvalError(f"evaluation.device is {requested!r} but only {len(gpus)} CUDA device(s) are visible")
    candidates = range(len(gpus)) if device.index is None else [device.index]
    directory = lock_dir() if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    started, waited = time.monotonic(), False
    while True:
        for index in candidates:
            handle = _try_lock(directory / f"{gpus[index]}.lock")
            if handle is not None:
                _held.append(handle)
                log.info("evaluating on cuda:%d (%s)%s", index, gpus[index],
                         f" after waiting {time.monotonic() - started:.0f} s" if waited else "")
                return torch.device("cuda", index)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise DflashEvalError(f"no free GPU for {requested!r} after {timeout_s:.0f} s: other evaluations hold "
                                  f"the locks in {directory}")
        if not waited:
            log.info("all GPUs for %r are held by other evaluations (locks in %s); waiting", requested, directory)
            waited = True
        time.sleep(poll_s)
