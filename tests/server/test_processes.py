"""processes: the listener on a port, the members of a process group, start times, checked against real
processes (and tests/support/servers.group_members, an independent reading of /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash_eval.server import processes
from dflash_eval.testing import fixtures
from tests.support import servers as hs

LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET6 if sys.argv[2] == '6' else socket.AF_INET)\n"
    "s.bind(('::1' if sys.argv[2] == '6' else '127.0.0.1', int(sys.argv[1])))\n"
    "s.listen()\n"
    "print('listening', flush=True)\n"
    "time.sleep(60)\n"
)


def listening_child(port: int, family: str = "4") -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), family], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "listening"
    return child


def test_listener_is_the_process_holding_the_listening_socket():
    port = fixtures.free_port()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert processes.listener(port, [os.getpid(), bystander.pid]) is None  # nothing listens yet
    child = listening_child(port)
    try:
        assert processes.listener(port, [os.getpid(), bystander.pid, child.pid]) == child.pid
        assert processes.listener(port, [bystander.pid]) is None  # only among the candidates
        assert processes.listener(fixtures.free_port(), [child.pid]) is None  # only on that port
    finally:
        for proc in (child, bystander):
            proc.kill()
            proc.wait()


def test_listener_on_ipv6():
    port = fixtures.free_port()
    try:
        child = listening_child(port, "6")
    except AssertionError:
        return  # no IPv6 loopback here
    try:
        assert processes.listener(port, [child.pid]) == child.pid
    finally:
        child.kill()
        child.wait()


def test_group_members_and_alive_after_the_leader_died():
    """A shell leading a group of two sleeps: killing the leader leaves the group alive (its members are
    what a stop must still reach); killing the group ends it."""
    leader = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    group = leader.pid
    deadline = time.monotonic() + 10
    while len(hs.group_members(group)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        assert processes.group_members(group) == sorted(hs.group_members(group), key=processes.process_start_ticks)
        assert processes.group_members(group)[0] == group and processes.group_alive(group)
        os.kill(group, signal.SIGKILL)
        leader.wait()  # reaped: the group has no leader now
        assert processes.process_start_ticks(group) is None
        assert len(processes.group_members(group)) == 2 and processes.group_alive(group)
    finally:
        os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes.group_alive(group):  # the sleeps' parent is gone: init reaps them
        assert time.monotonic() < deadline, hs.group_members(group)
        time.sleep(0.02)
    assert processes.group_members(group) == [] and processes.group_members(0) == []


def test_start_ticks_are_the_stat_field_and_a_zombie_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stat = Path(f"/proc/{child.pid}/stat").read_text().split()  # the command name (python3...) has no spaces
    assert processes.process_start_ticks(child.pid) == int(stat[21])  # starttime, field 22 of proc(5)
    child.kill()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split()[2] != "Z":  # dead, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert processes.process_start_ticks(child.pid) is None
    child.wait()
    assert processes.process_start_ticks(child.pid) is None
