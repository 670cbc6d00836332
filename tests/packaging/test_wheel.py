"""A built wheel, installed outside the checkout, runs the CLI: every command's parser, and the schema.

Before, every command of a non-editable install failed: the schema lay beside the package in the checkout,
not in it. The test builds the wheel from this checkout, installs it (no dependencies: they are this
environment's) into a fresh directory, and runs from a directory that holds no checkout, with nothing of
the checkout on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import io, sys, contextlib
import dflash_eval
from dflash_eval.cli import COMMANDS, build_parser, main
assert dflash_eval.__file__.startswith(sys.argv[1]), dflash_eval.__file__
for name in COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([name, "--help"])
        except SystemExit as stop:
            assert stop.code == 0, (name, stop.code)
    assert "usage: dflash-eval" in out.getvalue(), name
from dflash_eval.config import load_config
config = load_config(sys.argv[2])
import importlib, pkgutil, dflash_eval.testing  # what tests and benchmarks share works from the wheel too
testing = [m.name for m in pkgutil.iter_modules(dflash_eval.testing.__path__)]
for name in testing:
    assert importlib.import_module("dflash_eval.testing." + name).__file__.startswith(sys.argv[1]), name
from dflash_eval.testing.fixtures import build_tokenizer
assert len(build_tokenizer(sys.argv[3])) > 100
from dflash_eval.tools.config_reference import load_schema, render
assert "## evaluation" in render(load_schema())
print("testing", len(testing))
print("commands", len(COMMANDS), "target", config["target"]["path"], "bootstrap", config["evaluation"]["bootstrap"])
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: building writes build/ and *.egg-info, which must not land in the checkout
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", "results", ".snakemake", "resources", "build", "*.egg-info", "__pycache__", ".whl"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (built,) = out.glob("dflash_eval-*.whl")
    return built


def test_the_wheel_holds_every_data_file_the_package_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {
        str(p.relative_to(REPO / "src"))
        for p in (REPO / "src" / "dflash_eval").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert data and data <= names, sorted(data - names)


def test_a_wheel_install_outside_the_checkout_runs_every_command(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(REPO / "config.yaml", elsewhere / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # ahead of the editable install's path entry
    run = subprocess.run(
        [sys.executable, "-c", CHECK, str(site), "config.yaml", "tok"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # every module of the checkout's dflash_eval.testing is in the wheel and imports from it
    shared = len([p for p in (REPO / "src" / "dflash_eval" / "testing").glob("*.py") if p.name != "__init__.py"])
    assert "commands" in run.stdout and "bootstrap" in run.stdout and f"testing {shared}\n" in run.stdout
    console = site / "bin" / "dflash-eval"
    assert console.is_file()
