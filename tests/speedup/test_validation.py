"""The shipped record of how far estimates were from measured speedups, and what the summary says of it."""

from types import SimpleNamespace

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.report.speedup_section import validation_lines
from dflash_eval.speedup import labels, validation

CELL = {
    "shape": "8b",
    "target": "pure attention",
    "kind": "chain",
    "profile_method": "graphs",
    "draft_method": "graphs",
}


def test_an_entry_spans_its_cells_and_names_this_code():
    made = validation.entry(
        [{**CELL, "ratio": 0.98}, {**CELL, "ratio": 1.0412}, {**CELL, "ratio": 1.01}],
        labels.MEASURED,
        "NVIDIA H200",
        "2026-12-03",
        "abc1234",
        "benchmarks/results/speedup_validation.md",
    )
    assert (made["cells"], made["ratio_min"], made["ratio_max"]) == (3, 0.98, 1.041)
    assert made["estimate_code"] == validation.code_hash()
    text = validation.describe(labels.MEASURED, [made])
    assert "0.98-1.04 over 3 cells" in text and "this version's estimate code" in text


def test_an_entry_of_other_code_says_so_and_an_unrecorded_source_is_not_validated():
    old = {
        **validation.entry([{**CELL, "ratio": 2.0}], labels.MEASURED, "H200", "2026-12-02", "741c8bc", "r.md"),
        "estimate_code": "sha256:0000000000000000",
    }
    assert "earlier estimate code (741c8bc), not this version's" in validation.describe(labels.MEASURED, [old])
    assert validation.describe(labels.USER, [old]).startswith("'user profile' estimates: not validated")


def test_update_replaces_the_same_device_shape_and_kind_only(tmp_path):
    path = tmp_path / "record.json"
    first = validation.entry([{**CELL, "ratio": 2.0}], labels.MEASURED, "H200", "d1", None, "r.md")
    tree = validation.entry([{**CELL, "kind": "ddtree", "ratio": 1.5}], labels.MEASURED, "H200", "d1", None, "r.md")
    validation.update([first, tree], path)
    again = validation.entry([{**CELL, "ratio": 1.01}], labels.MEASURED, "H200", "d2", None, "r.md")
    validation.update([again], path)
    kept = validation.load(path)
    assert sorted((e["kind"], e["date"]) for e in kept) == [("chain", "d2"), ("ddtree", "d1")]
    path.write_text('{"entries": 3}')
    with pytest.raises(DflashEvalError, match="not a speedup validation record"):
        validation.load(path)


def test_the_shipped_record_loads_and_hashes_the_code_it_names():
    entries = validation.load()
    assert entries and all(e["source"] == labels.MEASURED and e["ratio_min"] <= e["ratio_max"] for e in entries)
    assert all(
        e["estimate_code"].startswith("sha256:") and e["record"].startswith("benchmarks/results/") for e in entries
    )


def test_the_summary_validates_each_source_an_estimate_was_made_from():
    evaluations = [
        SimpleNamespace(
            metrics={"speedup": {"available": True, "source": f"{labels.USER}; drafter step {labels.MEASURED}"}}
        ),
        SimpleNamespace(metrics={"speedup": {"available": False, "source": labels.NO_PROFILE}}),
    ]
    lines = validation_lines(evaluations)
    assert len(lines) == 2 and lines[0].startswith("- 'user profile' estimates: not validated")
    assert lines[1].startswith("- 'measured by us' estimates, validated (benchmarks/results/speedup_validation.md)")


def test_trust_json_carries_each_sources_entries_and_whether_they_ran_this_code():
    made = validation.entry([{**CELL, "ratio": 1.0}], labels.MEASURED, "H200", "d", None, "r.md")
    old = {**made, "date": "d0", "shape": "27b", "estimate_code": "sha256:0000000000000000"}
    panel = validation.panel([labels.MEASURED, labels.USER], [made, old])
    assert panel["estimate_code"] == validation.code_hash()
    assert [e["this_code"] for e in panel["sources"][labels.MEASURED]["entries"]] == [True, False]
    assert panel["sources"][labels.USER] == {"summary": validation.describe(labels.USER, []), "entries": []}
