"""A serving profile carried over to a rerun keeps the stamp of the code that timed it, and the summary's validation
line compares stamps, not the checkout: a profile timed by older estimate code is never reported as validated on
this code. The real extract stage, a real tiny target, the timing itself replaced (extract/profile's
measure_target: a CPU times nothing worth keeping)."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_eval.cache.reuse import kept_dir
from dflash_eval.cache.serving_profile import ESTIMATE_STAMP, PROFILE_NAME
from dflash_eval.evaluate.speedup_stamps import estimate_stamps
from dflash_eval.extract import profile
from dflash_eval.extract import stage as extract_stage
from dflash_eval.provenance import identity
from dflash_eval.provenance.stamps import STAMP, read_stamp
from dflash_eval.speedup import validation
from tests.support.extract_runs import extract_settings, tiny_records, write_records
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4]
SOURCE = "measured by us"


def _entry(code: str) -> dict:
    return {"source": SOURCE, "device": "H200", "date": "d", "shape": "s", "target": "t", "kind": "chain",
            "cells": 1, "ratio_min": 0.9, "ratio_max": 0.95, "profile_method": "graphs", "draft_method": "graphs",
            "estimate_code": code, "code_commit": None, "record": "a record"}


def test_a_profile_carried_over_a_change_of_the_timing_code_is_reported_as_timed_by_its_own_code(
        tmp_path, monkeypatch, caplog):
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    measured = {"t_ar_ms": 1.5, "t_verify_ms": {"1": 1.5, "8": 2.0}, "device": "cpu", "context_tokens": 16}
    monkeypatch.setattr(profile, "measure_target", lambda *a, **k: dict(measured))
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out, timed = tmp_path / "hidden", {"measure": True, "context_tokens": 16, "repeats": 1}
    extract_stage.extract(extract_settings(target_dir, speedup=timed), completions, out)
    old_code = identity.estimate_code_hash()
    assert json.loads((out / PROFILE_NAME).read_text())[ESTIMATE_STAMP] == old_code
    assert read_stamp(out) == identity.stage_identity("extract")  # the manifest's stamp

    # The target-timing code changes; the states' code does not: the rerun copies every state, loads no target,
    # and carries the kept profile, timed by the old code.
    monkeypatch.setattr(identity, "ESTIMATE_CODE", (*identity.ESTIMATE_CODE, "stats"))
    new_code = identity.estimate_code_hash()
    assert new_code != old_code
    shutil.rmtree(out)
    monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("model loaded"))
    with caplog.at_level("WARNING"):
        extract_stage.extract(extract_settings(target_dir, speedup=timed), completions, out)
    assert (out / PROFILE_NAME).samefile(kept_dir(out) / PROFILE_NAME)
    assert json.loads((out / PROFILE_NAME).read_text())[ESTIMATE_STAMP] == old_code, "the stamp stays the old code's"
    assert f"timed by estimate code {old_code}, not this estimate code ({new_code})" in caplog.text

    # The validation record was measured on the new code. Compared with the checkout (the check before stamps),
    # the line calls these numbers validated on this version although the profile behind them is the old code's:
    entries = [_entry(new_code)]
    assert "this version's estimate code" in validation.describe(SOURCE, entries)
    # Compared with the stamps the evaluation writes (metrics.json's speedup.estimate_code), it says which code:
    stamps = estimate_stamps(extract_settings(target_dir, speedup=timed), out)
    assert stamps == {"evaluation": new_code, "profile": old_code}
    line = validation.describe(SOURCE, entries, [stamps])
    assert "this version's" not in line and f"not the estimate code that made these numbers ({old_code})" in line
    assert "the estimate code that made these numbers)" in validation.describe(SOURCE, [_entry(old_code)],
                                                                               [{"evaluation": old_code,
                                                                                 "profile": old_code}])
    panel = validation.panel({SOURCE: [stamps]}, entries)
    assert panel["sources"][SOURCE]["entries"][0]["this_code"] is False


def test_numbers_made_before_stamps_are_not_called_validated_on_any_code():
    line = validation.describe(SOURCE, [_entry("sha256:0000000000000000")], [{}])
    assert "carry no estimate-code stamp" in line
    assert STAMP == "code_identity"
