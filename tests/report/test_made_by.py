"""summary.md's "Made by" section: the code identity of the report and, grouped, of what it was made from, the
same stamps as trust.json's (what `dflash-eval status` reads)."""

from __future__ import annotations

import json

from dflash_eval.io_utils import atomic_write_json
from dflash_eval.report import stage as report
from dflash_eval.report.stamps import lines
from tests.support.report_inputs import report_args, section, write_metrics


def test_stamps_are_grouped_and_counted_by_hand():
    inputs = {
        "evaluations": {"a/d1": "evaluate.v1.sha256:aa", "b/d1": "evaluate.v1.sha256:aa", "c/d1": None},
        "caches": {},
    }
    assert lines("report.v1.sha256:rr", inputs) == [
        "## Made by",
        "",
        "- this report: `report.v1.sha256:rr`",
        "- evaluations: `evaluate.v1.sha256:aa` (2); made before stamps (1)",
        "- hidden-state caches: none",
        "",
        "`dflash-eval status` names every output that other code made (docs/reruns.md).",
    ]


def test_the_summary_states_the_stamps_trust_json_holds(tmp_path):
    paths = write_metrics(tmp_path)
    older = json.loads(paths[0].read_text())
    atomic_write_json(paths[0], {**older, "code_identity": "evaluate.v1.sha256:older"})
    assert report.run(report_args(tmp_path, paths)) == 0
    trust = json.loads((tmp_path / "trust.json").read_text())
    body = section((tmp_path / "summary.md").read_text(), "## Made by")
    assert f"- this report: `{trust['code_identity']}`" in body
    evaluations = list(trust["inputs_code_identity"]["evaluations"].values())
    assert "evaluate.v1.sha256:older" in evaluations
    assert f"`evaluate.v1.sha256:older` ({evaluations.count('evaluate.v1.sha256:older')})" in body
