"""host_lock: an flock on the lock file itself (checked with a raw fcntl.flock, as another process or an older
dflash-eval would take it), re-entrant within a thread, exclusive between threads and processes."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_eval.server.lock import host_lock

HOLDER = (
    "import os, sys, time\n"
    "from pathlib import Path\n"
    "from dflash_eval.server.lock import host_lock\n"
    "with host_lock(Path(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    while not os.path.exists(sys.argv[2]):\n"
    "        time.sleep(0.02)\n"
)


def flock_free(path: Path) -> bool:
    """Whether an exclusive flock on `path` can be taken right now (released again at once)."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def test_another_process_holds_an_flock_on_the_file_until_it_releases(tmp_path):
    lock, go = tmp_path / "logs" / "server.lock", tmp_path / "go"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(go)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not flock_free(lock)
        waiter_done = threading.Event()

        def waiter() -> None:
            with host_lock(lock):
                waiter_done.set()

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not waiter_done.is_set()  # waits for the other process
        go.touch()
        assert holder.wait(timeout=30) == 0
        thread.join(timeout=30)
        assert waiter_done.is_set()
    finally:
        go.touch()
        holder.wait(timeout=30)
    assert lock.exists() and flock_free(lock)  # left in place, so that every waiter locks the same inode


def test_reentrant_within_a_thread_and_exclusive_between_threads(tmp_path):
    lock = tmp_path / "server.lock"
    order: list[str] = []

    def other() -> None:
        with host_lock(lock):
            order.append("other")

    with host_lock(lock), host_lock(lock):  # nested: no deadlock with itself
        assert not flock_free(lock)
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        time.sleep(0.3)
        order.append("main")
    thread.join(timeout=30)
    assert order == ["main", "other"]
    assert flock_free(lock)


def test_the_same_file_named_two_ways_is_one_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    with host_lock(Path("logs/server.lock")), host_lock(tmp_path / "logs" / "server.lock"):
        assert not flock_free(tmp_path / "logs" / "server.lock")


def test_released_after_an_exception(tmp_path):
    lock = tmp_path / "server.lock"
    with pytest.raises(RuntimeError), host_lock(lock), host_lock(lock):
        raise RuntimeError
    assert flock_free(lock)
