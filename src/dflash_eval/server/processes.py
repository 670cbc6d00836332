"""What /proc says about processes: start times (so that a reused pid is never taken for ours), the
members of a process group (what a managed server's stop must reach), and which process listens on a
port (the server itself, not the shell that its command runs in). Linux only, as is the rest of the
server control (process groups, flock)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses


def process_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie.

    Stored next to a pid so that a reused pid is never taken for the process we meant.
    """
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out: they hold nothing) whose process group is `pgid`, oldest first."""
    if pgid <= 0:
        return []  # 0 would be our own group (and kernel threads' pgrp)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # the common case after a stop, without reading the whole process table
    except PermissionError:
        pass  # someone else's group: it still has members
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append((int(fields[19]), int(entry.name)))
    return [pid for _, pid in sorted(members)]


def group_alive(pgid: int) -> bool:
    """Whether any live process is in group `pgid`: group_members without reading the whole process table
    while the group's leader runs (what a wait polls for, every fraction of a second)."""
    if process_start_ticks(pgid) is not None and pgid > 0:
        with contextlib.suppress(OSError):
            if os.getpgid(pgid) == pgid:
                return True
    return bool(group_members(pgid))


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (IPv4 or IPv6, any address) in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listener(port: int, candidates: list[int]) -> int | None:
    """The first of `candidates` that holds a socket listening on `port`, or None (not listening yet, or in
    another network namespace, as behind docker's port forwarding)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return None
    for pid in candidates:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return pid
            except OSError:
                continue
    return None


def port_holder(port: int) -> int | None:
    """The process listening on TCP `port`, among all this host's processes that we may read, or None (another
    user's, or another network namespace's, as behind docker's port forwarding). Reads the whole process table:
    only for an error message."""
    pids = sorted(int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    return listener(port, pids)


def process_facts(pid: int) -> dict:
    """What /proc says of a process for a person: its command line, its working directory and its environment
    (each None when it cannot be read)."""
    facts: dict = {"pid": pid, "cmdline": None, "cwd": None, "environ": None}
    with contextlib.suppress(OSError):
        facts["cmdline"] = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        )
    with contextlib.suppress(OSError):
        facts["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    with contextlib.suppress(OSError):
        pairs = (item.partition(b"=") for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
        facts["environ"] = {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}
    return facts
