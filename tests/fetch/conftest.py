"""The fetch tests' served demo server (tests/support/demo_server.py), speculating for real."""

from __future__ import annotations

import pytest

from dflash_eval.server.control import ServerController
from tests.support.demo_server import demo_server


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
