"""The SGLang 0.5.23 source tree the protocol tests read (never imported whole: its modules need SGLang's
dependencies). A pytest plugin of tests/conftest.py: `sglang_srt` is a fixture of every test."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def sglang_srt() -> Path:
    """`sglang/srt` of 0.5.23: $DFLASH_EVAL_SGLANG_SRC, else an installed wheel (`pip install --no-deps
    sglang==0.5.23`); skips without one (.ci/run downloads and unzips the wheel and sets the variable)."""
    if os.environ.get("DFLASH_EVAL_SGLANG_SRC"):
        srt = Path(os.environ["DFLASH_EVAL_SGLANG_SRC"])
        if not (srt / "entrypoints/openai/protocol.py").is_file():
            pytest.fail(
                f"DFLASH_EVAL_SGLANG_SRC={srt} is not an sglang/srt directory (no entrypoints/openai/protocol.py)"
            )
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip(
                "SGLang's source is not installed: pip install --no-deps sglang==0.5.23 (or set DFLASH_EVAL_SGLANG_SRC)"
            )
        srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    version_file = srt.parent / "_version.py"  # written by the wheel's build
    version = version_file.read_text() if version_file.is_file() else ""
    if "'0.5.23'" not in version and '"0.5.23"' not in version:
        pytest.skip(f"the SGLang source at {srt} is not 0.5.23: {version.strip()[-200:]}")
    return srt


def load_source_module(path: Path, name: str):
    """Load one dependency-free SGLang source file as a module (e.g. utils/auth.py), without the package."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
