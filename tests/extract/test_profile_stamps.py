"""A serving profile is stamped with the estimate code that timed it; a rerun that copies every state carries the
kept profile only when this code (or code older than stamps) timed it, else times the target again; and the
summary's validation line compares stamps, not the checkout: a profile timed by older code is never reported as
validated on this code. The real extract stage, a real tiny target, the timing itself replaced (extract/profile's
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
from tests.support.extract_runs import (
    Counting,
    extract_settings,
    tiny_records,
    write_records,
)
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4]
SOURCE = "measured by us"


def _entry(code: str) -> dict:
    return {"source": SOURCE, "device": "H200", "date": "d", "shape": "s", "target": "t", "kind": "chain",
            "cells": 1, "ratio_min": 0.9, "ratio_max": 0.95, "profile_method": "graphs", "draft_method": "graphs",
            "estimate_code": code, "code_commit": None, "record": "a record"}


def _extracted(tmp_path, monkeypatch):
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    timings = []
    measured = {"t_ar_ms": 1.5, "t_verify_ms": {"1": 1.5, "8": 2.0}, "device": "cpu", "context_tokens": 16}
    monkeypatch.setattr(profile, "measure_target", lambda *a, **k: timings.append(1) or dict(measured))
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out = tmp_path / "hidden"
    settings = extract_settings(target_dir, speedup={"measure": True, "context_tokens": 16, "repeats": 1})
    extract_stage.extract(settings, completions, out)
    assert json.loads((out / PROFILE_NAME).read_text())[ESTIMATE_STAMP] == identity.estimate_code_hash()
    assert read_stamp(out) == identity.stage_identity("extract")  # the manifest's stamp
    assert timings == [1]
    return settings, completions, out, timings


def test_a_profile_timed_before_stamps_and_carried_is_not_called_validated_on_this_code(tmp_path, monkeypatch,
                                                                                       caplog):
    """The case as it happened before stamps: a rerun that copies every state loads no target and carries the kept
    profile, whatever code timed it; the validation line compared the checkout and called it validated."""
    settings, completions, out, timings = _extracted(tmp_path, monkeypatch)
    kept = kept_dir(out) / PROFILE_NAME  # as the previous release wrote it: no stamp
    kept.write_text(json.dumps({k: v for k, v in json.loads(kept.read_text()).items() if k != ESTIMATE_STAMP}))
    shutil.rmtree(out)
    monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("model loaded"))
    with caplog.at_level("WARNING"):
        extract_stage.extract(settings, completions, out)
    assert (out / PROFILE_NAME).samefile(kept) and timings == [1], "carried, not timed"
    assert "timed by code older than stamps" in caplog.text

    current = identity.estimate_code_hash()
    entries = [_entry(current)]  # the validation record, measured on this estimate code
    # compared with the checkout (the check before stamps), these numbers are called validated on this code:
    assert "this version's estimate code" in validation.describe(SOURCE, entries)
    # compared with the stamps the evaluation writes (metrics.json's speedup.estimate_code), they are not:
    stamps = estimate_stamps(settings, out)
    assert stamps == {"evaluation": current, "profile": "unstamped (timed before stamps)"}
    line = validation.describe(SOURCE, entries, [stamps])
    assert "this version's" not in line
    assert "not the estimate code that made these numbers (unstamped (timed before stamps))" in line
    assert validation.panel({SOURCE: [stamps]}, entries)["sources"][SOURCE]["entries"][0]["this_code"] is False
    same = {"evaluation": current, "profile": current}
    assert "; the estimate code that made these numbers)" in validation.describe(SOURCE, entries, [same])


def test_a_profile_that_other_estimate_code_timed_is_timed_again_and_the_states_are_still_copied(
        tmp_path, monkeypatch, caplog):
    settings, completions, out, timings = _extracted(tmp_path, monkeypatch)
    old_code = identity.estimate_code_hash()
    monkeypatch.setattr(identity, "ESTIMATE_CODE", (*identity.ESTIMATE_CODE, "stats"))  # the timing code changed
    assert identity.estimate_code_hash() != old_code
    shutil.rmtree(out)
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(settings, completions, out)
    assert counter.calls == 0, "every state copied"
    assert timings == [1, 1], "the target timed again"
    assert json.loads((out / PROFILE_NAME).read_text())[ESTIMATE_STAMP] == identity.estimate_code_hash()
    assert f"timed by estimate code {old_code}, not this one" in caplog.text
    assert estimate_stamps(settings, out)["profile"] == identity.estimate_code_hash()

    shutil.rmtree(out)  # the same code again: the profile is carried, nothing is loaded
    monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("model loaded"))
    extract_stage.extract(settings, completions, out)
    assert timings == [1, 1] and (out / PROFILE_NAME).samefile(kept_dir(out) / PROFILE_NAME)


def test_numbers_made_before_stamps_are_not_called_validated_on_any_code():
    line = validation.describe(SOURCE, [_entry("sha256:0000000000000000")], [{}])
    assert "carry no estimate-code stamp" in line
    assert STAMP == "code_identity"
