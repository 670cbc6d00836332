"""benchmarks/record.py's checkout_commit: a record names the commit whose code ran, or says it did not."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def record_module():
    spec = importlib.util.spec_from_file_location("record_under_test", BENCHMARKS / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path


def test_a_clean_checkout_is_its_head(repo: Path) -> None:
    (repo / "untracked.txt").write_text("not code\n")  # untracked files are not the code that ran
    assert record_module().checkout_commit(repo) == git(repo, "rev-parse", "--short", "HEAD")


def test_a_changed_work_tree_is_not_called_its_head(repo: Path) -> None:
    """The GPU machine's copy: the work tree is newer than the .git it came with."""
    (repo / "code.py").write_text("x = 2\n")
    assert record_module().checkout_commit(repo) == git(repo, "rev-parse", "--short", "HEAD") + "+changes"


def test_no_git_is_none(tmp_path: Path) -> None:
    assert record_module().checkout_commit(tmp_path) is None
