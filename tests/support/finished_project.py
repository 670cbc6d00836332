"""A finished run of the tiny project (the recording dflash-eval), copied per test: the fault tests make one fault
in a project whose results all exist and check that nothing already written was lost (`refused`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_eval.testing.workflow import check, snakemake, tiny_project
from tests.support.checkout import copy_workflow


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every result file's bytes and mtime."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted((root / "results").rglob("*"))
        if p.is_file() and "logs" not in p.parts
    }


def refused(workflow: Path, root: Path, *args: str) -> str:
    """The output of a snakemake run on `root` that must fail before any job: nothing ran, nothing was rewritten."""
    before = snapshot(root)
    run = snakemake(workflow, root, *args)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "Nothing to be done" not in text, text
    assert snapshot(root) == before, "nothing was removed or rewritten"
    assert not (root / "calls.log").exists(), "no job ran"
    return text


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    workflow = copy_workflow(root / "workflow")
    project = root / "base"
    tiny_project(project, big_checkpoint=False)
    check(snakemake(workflow, project))
    return workflow, project


def copy_of(project: Path, dest: Path, logs: tuple[str, ...] = ("calls.log",)) -> Path:
    """A copy of a finished project, as up to date as the original (copy2 keeps mtimes), its call logs removed."""
    shutil.copytree(project, dest)
    for name in logs:
        (dest / name).unlink(missing_ok=True)
    return dest


@pytest.fixture
def case(finished, tmp_path):
    workflow, project = finished
    return workflow, copy_of(project, tmp_path / "case")
