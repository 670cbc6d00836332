"""The checkout these tests run from, and the workflow copied from it (dflash_eval.testing.workflow's copies)."""

from __future__ import annotations

from pathlib import Path

from dflash_eval.testing import workflow

REPO = Path(__file__).resolve().parents[2]


def copy_workflow(dest: Path) -> Path:
    """This checkout's workflow and package copied to `dest`, with the recording `dflash-eval`."""
    return workflow.copy_workflow(dest, REPO)


def copy_workflow_with_stand_in(dest: Path, stand_in: str) -> Path:
    """`copy_workflow` whose `dflash-eval` is the script template `stand_in`, the recorder beside it."""
    return workflow.copy_workflow_with_stand_in(dest, REPO, stand_in)
