"""The checkout these tests run from, and the workflow copied from it (dflash_eval.testing.workflow's copies)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_eval.testing import workflow

REPO = Path(__file__).resolve().parents[2]


def copy_workflow(dest: Path) -> Path:
    """This checkout's workflow and package copied to `dest`, with the recording `dflash-eval`."""
    return workflow.copy_workflow(dest, REPO)


def copy_workflow_with_stand_in(dest: Path, stand_in: str) -> Path:
    """`copy_workflow` whose `dflash-eval` is the script template `stand_in`, the recorder beside it."""
    return workflow.copy_workflow_with_stand_in(dest, REPO, stand_in)


def snakemake_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    """This checkout's Snakefile run in project `root` with its config.yaml, on 2 cores, offline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(root),
        "--configfile",
        str(root / "config.yaml"),
        "--cores",
        "2",
        *args,
    ]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
