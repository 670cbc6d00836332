"""Which GPU an evaluation runs on: `cuda` takes a free one, and no two evaluations share one.

Snakemake's `gpu` resource caps how many GPU jobs run at once but not which GPU each one takes, so
several evaluations on one machine would all land on cuda:0. Each evaluation therefore holds an
exclusive lock on one file per GPU for as long as it runs (`flock`: the kernel drops it when the
process ends, crash or kill included, so a stale lock cannot exist). `cuda` takes the first GPU whose
lock is free and waits while all are held; `cuda:N` waits for GPU N. Lock files are named by the
GPU's UUID where torch reports one, so jobs with different CUDA_VISIBLE_DEVICES still exclude each
other; they live in $DFLASH_EVAL_GPU_LOCKS (default: <tmp>/dflash-eval-gpus).

What was claimed is also written down (`record`): which GPU, by index and identity, which process on which
host, and when the claim started and ended, as a small JSON file (the workflow puts it beside the job's
benchmark). `dflash_eval.evaluate.placement` reads those files back and checks that no two jobs held one
GPU at once: the proof that the locks did their job, on a real machine as in the tests.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from dflash_eval.errors import DflashEvalError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_held: list[IO] = []  # the claimed locks, kept open for the life of the process
_open_records: list[tuple[Path, dict]] = []  # claim records whose end is written by `release_all`


def lock_dir() -> Path:
    return Path(os.environ.get("DFLASH_EVAL_GPU_LOCKS") or Path(tempfile.gettempdir()) / "dflash-eval-gpus")


def visible_gpus() -> list[str]:
    """An identity per visible CUDA device, in index order: its UUID, else its index."""
    import torch  # here, not at the top: the placement checker and the workflow tests' stand-ins need no torch

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


def claim_device(
    requested: str,
    gpus: Sequence[str] | None = None,
    directory: Path | None = None,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    record: Path | str | None = None,
    job: str = "",
) -> torch.device:
    """The device to evaluate on; for `cuda` / `cuda:N` a GPU that no other evaluation holds (`claim_gpu`)."""
    import torch

    device = torch.device(requested)
    if device.type != "cuda":
        if record is not None:
            _write_record(
                Path(record), {**_identity(job, requested), "device": str(device), "start": time.time()}, finish=True
            )
        return device
    index = claim_gpu(device.index, requested, gpus, directory, poll_s, timeout_s, record, job)
    return torch.device("cuda", index)


def claim_gpu(
    index: int | None,
    requested: str,
    gpus: Sequence[str] | None = None,
    directory: Path | None = None,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    record: Path | str | None = None,
    job: str = "",
) -> int:
    """Lock GPU `index` (None: the first free one) for the rest of this process and return its index.

    `gpus` (identities, one per visible index) defaults to the visible CUDA devices; tests pass their own
    (and need no torch then). `record`: a JSON file that says what was claimed, when, by which process (`job`
    names it there); its `end` is written when the process exits (normally, or through SIGTERM turned into an
    exception; a SIGKILL leaves it without one, which the placement check reports).
    """
    gpus = list(visible_gpus() if gpus is None else gpus)
    if not gpus:
        raise DflashEvalError(
            f"evaluation.device is {requested!r} but no CUDA device is visible; "
            "set evaluation.device: cpu or run on a GPU machine"
        )
    if index is not None and index >= len(gpus):
        raise DflashEvalError(f"evaluation.device is {requested!r} but only {len(gpus)} CUDA device(s) are visible")
    candidates = range(len(gpus)) if index is None else [index]
    directory = lock_dir() if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    started, waited = time.monotonic(), False
    while True:
        own = _own(directory, gpus, candidates)
        for index in [*(i for i in candidates if i not in own), *own]:
            held = index in own
            handle = None if held else _try_lock(directory / f"{gpus[index]}.lock")
            if handle is not None or held:
                if handle is not None:
                    _held.append(handle)
                log.info(
                    "evaluating on cuda:%d (%s), pid %d on %s, CUDA_VISIBLE_DEVICES=%s%s%s",
                    index,
                    gpus[index],
                    os.getpid(),
                    socket.gethostname(),
                    os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
                    f" after waiting {time.monotonic() - started:.0f} s" if waited else "",
                    " (this process holds it already)" if held else "",
                )
                if record is not None:
                    _write_record(
                        Path(record),
                        {
                            **_identity(job, requested),
                            "device": f"cuda:{index}",
                            "index": index,
                            "gpu": gpus[index],
                            "lock": str(directory / f"{gpus[index]}.lock"),
                            "waited_s": round(time.monotonic() - started, 3),
                            "start": time.time(),
                        },
                    )
                return index
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise DflashEvalError(
                f"no free GPU for {requested!r} after {timeout_s:.0f} s: other evaluations hold "
                f"the locks in {directory}"
            )
        if not waited:
            log.info("all GPUs for %r are held by other evaluations (locks in %s); waiting", requested, directory)
            waited = True
        time.sleep(poll_s)


def _own(directory: Path, gpus: list[str], candidates: Sequence[int]) -> list[int]:
    """The candidates whose lock this process holds already (an earlier evaluation of the same process): tried after
    every free GPU, and never waited for, since a process waiting for its own lock waits forever."""
    mine = {handle.name for handle in _held if not handle.closed}
    return [index for index in candidates if str(directory / f"{gpus[index]}.lock") in mine]


def _identity(job: str, requested: str) -> dict:
    return {
        "job": job,
        "requested": requested,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _write_record(path: Path, record: dict, finish: bool = False) -> None:
    """Write the claim now (so a killed job still leaves its start); its end when this process exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if finish:
        record["end"] = record["start"]
    _dump(path, record)
    if not finish:
        _open_records.append((path, record))


@atexit.register
def release_all() -> None:
    """End this process's claims now: each open record gets its end, then every lock is dropped.

    Runs at the process's exit by itself; a process that goes on (a forked benchmark worker, whose exit
    skips atexit) calls it when its evaluation is done. The end is written before the lock is dropped, so
    two records of one GPU can only overlap if the locks failed."""
    while _open_records:
        path, record = _open_records.pop()
        end = time.time()
        _dump(path, {**record, "end": end})
        log.info("released %s (%s) after %.1f s", record["device"], record["gpu"], end - record["start"])
    while _held:
        _held.pop().close()


def _dump(path: Path, record: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)
