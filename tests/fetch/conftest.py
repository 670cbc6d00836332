"""The fetch tests' fixtures: the served demo server (tests/support/demo_server.py), speculating for real, and vLLM's source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_eval.server.control import ServerController
from tests.support.demo_server import demo_server


@pytest.fixture(scope="session")
def vllm_src() -> Path:
    """The `vllm` package directory of the 0.34.0 wheel: $DFLASH_EVAL_VLLM_SRC (.ci/run unzips the wheel's
    protocol sources and sets it); skips without it (the wheel is 500 MB, never installed here)."""
    if not os.environ.get("DFLASH_EVAL_VLLM_SRC"):
        pytest.skip(
            "vLLM 0.34.0's source is not here: set DFLASH_EVAL_VLLM_SRC to the `vllm` directory of the "
            "unzipped wheel (pip download --no-deps vllm==0.34.0; .ci/run does it)"
        )
    package = Path(os.environ["DFLASH_EVAL_VLLM_SRC"])
    if not (package / "entrypoints/openai/completion/protocol.py").is_file():
        pytest.fail(
            f"DFLASH_EVAL_VLLM_SRC={package} is not a vllm package directory "
            "(no entrypoints/openai/completion/protocol.py)"
        )
    version_file = package / "_version.py"
    version = version_file.read_text() if version_file.is_file() else ""
    if "'0.34.0'" not in version and '"0.34.0"' not in version:
        pytest.skip(f"the vLLM source at {package} is not 0.34.0: {version.strip()[-200:]}")
    return package


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The SGLang-protocol demo server of the tiny target and drafter, up; yields its settings and model paths."""
    base = tmp_path_factory.mktemp("sglang")
    settings, target, drafter = demo_server(base, algorithm="dflash")  # upper-cased by the server, as SGLang does
    controller = ServerController(settings)
    controller.ensure_up()
    try:
        yield {"settings": settings, "target": target, "drafter": drafter, "base": base}
    finally:
        controller.stop_if_launched()
