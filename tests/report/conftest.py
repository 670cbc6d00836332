"""One report of the fixtures' full inputs, shared by the tests that only read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_eval.report import stage as report
from tests.support.report_inputs import report_args, write_metrics, write_trust_inputs


@pytest.fixture(scope="package")
def out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    hidden, completions, transitions = write_trust_inputs(root)
    assert (
        report.run(
            report_args(root, write_metrics(root), hidden=hidden, completions=completions, transitions=transitions)
        )
        == 0
    )
    return root
