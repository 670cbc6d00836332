"""The report's kernel-backend section: compare-backends results as the workflow's rule writes them."""

from __future__ import annotations

import json

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.report import stage as report
from tests.support.report_inputs import report_args, section, write_metrics

# compare_backends' result format (tools/compare_backends.py), figures of the demo's H200 record
RESULT = {
    "candidate": "fla",
    "reference": "torch",
    "samples": 59,
    "tokens": 7436,
    "layers": [
        {"layer": 1, "tokens": 7436, "cos_mean": 0.999991, "cos_min": 0.999874, "rel_l2": 4.0e-3, "max_abs": 0.0234},
        {"layer": 5, "tokens": 7436, "cos_mean": 0.999984, "cos_min": 0.999929, "rel_l2": 5.7e-3, "max_abs": 0.0625},
    ],
    "drafter": {
        "method": "chain-B8",
        "tau": {"fla": 6.449, "torch": 6.4312},
        "tau_difference": 0.0178,
        "samples_differing": 2,
    },
}


def _comparison(root, drafter="d1", dataset="s1", dtype="bfloat16"):
    path = root / "backends" / drafter / dataset / f"{dtype}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULT))
    return path


def test_comparisons_are_a_section_of_the_summary_and_of_trust_json(tmp_path):
    paths = [_comparison(tmp_path), _comparison(tmp_path, dtype="float32")]
    assert report.run(report_args(tmp_path, write_metrics(tmp_path), backend_comparisons=paths)) == 0
    text = (tmp_path / "summary.md").read_text()
    body = section(text, "## Kernel backends: fla against torch on the same completions")
    rows = [line for line in body.splitlines() if line.startswith("| d1") or line.startswith("|  |")]
    assert rows[0] == (
        "| d1 | s1 | bfloat16 | 59 | 1 | 0.999991 | 0.999874 | 4.00e-03 | 0.0234 | 6.449 | 6.431 | 2 of 59 |"
    )
    assert rows[1] == "|  |  |  |  | 5 | 0.999984 | 0.999929 | 5.70e-03 | 0.0625 |  |  |  |"
    assert rows[2].startswith("| d1 | s1 | float32 | 59 | 1 |")
    trust = json.loads((tmp_path / "trust.json").read_text())
    assert [(c["drafter"], c["dataset"], c["dtype"]) for c in trust["backend_comparisons"]] == [
        ("d1", "s1", "bfloat16"),
        ("d1", "s1", "float32"),
    ]
    assert trust["backend_comparisons"][0]["result"]["drafter"]["tau"]["fla"] == 6.449


def test_without_comparisons_the_summary_has_no_such_section(tmp_path):
    assert report.run(report_args(tmp_path, write_metrics(tmp_path))) == 0
    assert "Kernel backends" not in (tmp_path / "summary.md").read_text()
    assert "backend_comparisons" not in json.loads((tmp_path / "trust.json").read_text())


def test_a_damaged_comparison_names_the_file_and_the_rerun(tmp_path):
    path = _comparison(tmp_path)
    path.write_text("{not json")
    with pytest.raises(
        DflashEvalError, match=r"bfloat16.json: not a compare-backends result .*--forcerun compare_backends"
    ):
        report.run(report_args(tmp_path, write_metrics(tmp_path), backend_comparisons=[path]))
