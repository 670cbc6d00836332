"""The console script's start and exit: the stage imported with the collector off, then on again; exit code kept."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from dflash_eval import cli
from tests.support import heap

BAD = '{"kind": "managed"}'  # refused settings: exit 2, without starting anything


def test_console_script_imports_without_collections_and_keeps_the_exit_code(monkeypatch):
    seen = {}
    real = cli.build_parser

    def build(only=None):
        seen["collector during the import"] = gc.isenabled()
        return real(only=only)

    monkeypatch.setattr(cli, "build_parser", build)
    monkeypatch.setattr(sys, "argv", ["dflash-eval", "server", "status", "--settings", BAD])
    gc.unfreeze()
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.entry()
        assert seen == {"collector during the import": False}
        assert gc.isenabled(), "the collector must run again once the stage is imported"
        assert gc.get_freeze_count() > frozen, "what the imports made is frozen"
        assert exit_.value.code == cli.main(["server", "status", "--settings", sys.argv[-1]])
        assert exit_.value.code == 2
    finally:
        gc.unfreeze()


def test_in_process_main_freezes_nothing(monkeypatch):
    """A test session (or any long-lived caller) keeps its collector as it was."""
    gc.unfreeze()
    assert cli.main(["server", "status", "--settings", BAD]) == 2
    assert heap.unfrozen() and gc.isenabled()


def test_module_entry_point_runs_the_console_script():
    done = subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", "server", "status", "--settings", BAD],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
