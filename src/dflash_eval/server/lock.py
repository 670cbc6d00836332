"""The host lock: an exclusive lock on a file in the server's log_dir, shared by every dflash-eval process
of the host (and of other hosts that see the same log_dir with a working flock).

filelock's FileLock does the locking: flock on Linux, the lock file left in place so that every waiter
locks the same inode, re-entrant, each thread holding it on its own (thread_local). One FileLock per path
per process, kept here: a second flock on a new file descriptor of the same process would wait for itself
(filelock's is_singleton re-initialises its instance on every call before 3.15.2, which does just that).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)
# filelock waits by polling and logs two DEBUG lines at each poll (forty a second while an extraction waits for
# another): `dflash-eval -v` would drown in them; "waiting for the lock" below says it once.
logging.getLogger("filelock").setLevel(logging.INFO)

_LOCKS: dict[Path, FileLock] = {}  # one per lock file in this process


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on `path` for the block; re-entrant within one thread."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _LOCKS.get(path)
    if lock is None:
        lock = _LOCKS.setdefault(path, FileLock(path, thread_local=True))
    try:
        lock.acquire(blocking=False)
    except Timeout:
        log.info("waiting for the lock %s", path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
