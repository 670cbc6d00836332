"""The fetch stage's resumable state: completed records appended to `<out>.partial`, kept after the end.

Hours of completions must survive a dropped connection, a killed job, Ctrl-C, and a rerun: Snakemake
deletes a rule's outputs before it reruns the rule (after a prompt was added, a setting changed, the
code changed), so the state lives beside the output, never in it: `results/completions/x.jsonl.partial`
collects finished records; when every record is there the output is written in prompt order
(temporary name, then rename), and the partial file becomes a hard link of the output (no extra
disk; a copy where links fail). A rerun, whatever Snakemake removed, reuses every record there that
answers the same request, and a file compacted to the last output does not grow from run to run.

Appends are whole lines, written with one O_APPEND write per batch and fsynced, so a crash can only
leave a torn *last* line (a write cut short), which the next run drops with a warning. The write is
done at once (a killed process loses nothing written); the fsync (against power loss) runs in a worker
thread, one at a time, and the last one is waited for on close: on a loaded disk an fsync takes long
enough (benchmarks/results/fetch_speed.md) that the event loop adding the records would otherwise stall its
requests. An exclusive flock keeps two fetches of the same output from interleaving their appends.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_eval.completions import parse_line, serialize
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_bytes

log = logging.getLogger(__name__)


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def read_records(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The records of a JSONL file we wrote. A torn last line (no newline) is dropped with a warning,
    and cut off the file when `repair`; any other unreadable line is an error naming the line."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning(
            "%s: dropping a torn last line (%d bytes without a newline: a run was killed while writing)",
            path,
            len(data) - end,
        )
        if repair:
            with open(path, "r+b") as fh:
                fh.truncate(end)
    lines = data[:end].split(b"\n")[:-1]
    return [parse_line(path, lineno, line) for lineno, line in enumerate(lines, start=1) if line.strip()]


class PartialStore:
    """Append-only, locked, batched writer of completed records (use as a context manager)."""

    def __init__(self, out: Path, flush_s: float = 1.0, flush_records: int = 256) -> None:
        self.out = Path(out)
        self.path = partial_path(self.out)
        self.flush_s = flush_s
        self.flush_records = flush_records
        self._fd: int | None = None
        self._syncer: ThreadPoolExecutor | None = None
        self._synced: Future[None] | None = None  # the latest fsync handed to the worker
        self._sync_error: OSError | None = None  # the first failed fsync (a later one on the same fd may pass)
        self._buffer: list[bytes] = []
        self._lines: dict[str, bytes] = {}  # each record added by this run, serialized, by id: reused by finish
        self._last_flush = time.monotonic()

    def __enter__(self) -> PartialStore:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_nlink > 1:  # still the last output's link: appending
            _replace_with_copy(self.path)  # would change that output too
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise DflashEvalError(
                f"{self.path} is locked by another running fetch of the same output; wait for it"
            ) from None
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            self.flush()
        finally:
            if self._syncer is not None:
                self._syncer.shutdown(wait=True)  # every queued fsync done before the descriptor closes
                self._syncer = None
            if self._fd is not None:
                os.close(self._fd)  # releases the lock
                self._fd = None
        if exc_type is None:  # an exception on its way out is the one to report
            self._raise_sync_error()  # a failed fsync is an error, not a silent loss

    def _fsync(self) -> None:
        """fsync on the worker thread, keeping the first failure for the main thread to raise."""
        try:
            os.fsync(self._fd)
        except OSError as error:
            self._sync_error = self._sync_error or error

    def _raise_sync_error(self) -> None:
        if self._sync_error is not None:
            raise DflashEvalError(
                f"{self.path}: fsync failed ({self._sync_error}); the completions written since the "
                "last successful fsync may not be on disk; free the disk or fix it, then rerun "
                "(finished records are kept)"
            ) from self._sync_error

    def load(self) -> list[dict[str, Any]]:
        """Records from earlier runs, oldest first: the output itself if it is there (a run by hand) and
        not the partial file's link, then the partial file (its torn last line cut off). An id may come
        more than once (a request that changed was fetched again): the caller picks (`pick_kept`)."""
        records: list[dict[str, Any]] = []
        for path in (self.out, self.path):
            if path == self.out and self.path.exists() and path.exists() and os.path.samefile(path, self.path):
                continue
            if path.exists() and path.stat().st_size:
                records += read_records(path, repair=path == self.path)
        return records

    def add(self, record: dict[str, Any]) -> None:
        """Queue one finished record; written with the batch once flush_s passed or flush_records queued."""
        line = serialize(record)
        self._lines[str(record["id"])] = line
        self._buffer.append(line)
        if len(self._buffer) >= self.flush_records or time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Append the queued records as one write, and have them fsynced."""
        self._last_flush = time.monotonic()
        if not self._buffer or self._fd is None:
            return
        data = memoryview(b"".join(self._buffer))
        self._buffer.clear()
        while data:  # a write may be short; O_APPEND keeps each piece at the end
            data = data[os.write(self._fd, data) :]
        self._raise_sync_error()  # an earlier fsync's failure, here rather than at the end
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync")
        self._synced = self._syncer.submit(self._fsync)

    def finish(self, records: Iterable[dict[str, Any]]) -> None:
        """Write the complete output atomically, then drop the partial file.

        A record added by this run is written as add() serialized it (the record of its id must not
        have changed since); only the kept ones are serialized here.
        """
        self.flush()
        if self._synced is not None:
            self._synced.result()
        self._raise_sync_error()  # before the output is written and the partial file dropped
        lines = self._lines
        atomic_write_bytes(self.out, b"".join(lines.get(str(r["id"])) or serialize(r) for r in records))
        _link_or_copy(self.out, self.path)  # what the next run reuses, whatever Snakemake removes
        lines.clear()


def _link_or_copy(source: Path, dest: Path) -> None:
    """Atomically make `dest` a hard link of `source`, or a copy where the file system has no links."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)


def _replace_with_copy(path: Path) -> None:
    """Give `path` an inode of its own (a copy of its content), so writing to it leaves its other links alone."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.copyfile(path, tmp)
    os.replace(tmp, path)


def pick_kept(records: list[dict[str, Any]], wanted: set[str], request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One earlier record per wanted id: the latest that was made with `request`, else the latest.

    The record's messages and server are checked where it would be reused (fetch.stage.reusable).
    """
    kept: dict[str, dict[str, Any]] = {}
    for rec in records:  # oldest first: a later one replaces an earlier one unless only the earlier fits
        rid = str(rec["id"])
        if rid in wanted and (rid not in kept or rec.get("request") == request or kept[rid].get("request") != request):
            kept[rid] = rec
    return kept
