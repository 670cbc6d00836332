"""Helpers of the server-control tests: controllers that clean up after a test, the transitions a run logged,
and a separate process that holds the server paused as an extraction job does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_eval.server.control import ServerController


def transitions(log_dir: Path | str) -> list[str]:
    path = Path(log_dir) / "transitions.jsonl"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def controllers():
    """Controllers made by a test; whatever they launched is stopped afterwards (keep_running or not)."""
    made: list[ServerController] = []
    yield made
    for ctl in made:
        ServerController({**ctl.settings, "keep_running": False}).stop_if_launched()


def make(controllers: list, settings: dict) -> ServerController:
    ctl = ServerController(settings)
    controllers.append(ctl)
    return ctl


def entries(log_dir: Path | str) -> list[dict]:
    path = Path(log_dir) / "transitions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


PAUSER = (
    "import json, os, sys, time\n"
    "from dflash_eval.server.control import server_paused\n"
    "with server_paused(json.loads(sys.argv[1])):\n"
    "    print('inside', flush=True)\n"
    "    time.sleep(float(sys.argv[2]))\n"
    "    while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):\n"
    "        time.sleep(0.05)\n"
    "print('done', flush=True)\n"
)


def pauser(settings: dict, seconds: float, until: Path | None = None) -> subprocess.Popen:
    """A separate process that holds the server paused for `seconds` (and then until the file `until`
    exists), as an extraction job does."""
    args = [str(seconds)] + ([str(until)] if until else [])
    return subprocess.Popen(
        [sys.executable, "-c", PAUSER, json.dumps(settings), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
