"""Expected speedup: hand-computed cases, which profile wins."""

import json

import pytest

from dflash_eval.cache.serving_profile import PROFILE_NAME, check_profile
from dflash_eval.evaluate import speedup
from dflash_eval.speedup import labels, model


def _method(kind, size, tau):
    return {"kind": kind, "block_size": 16 if kind == "ddtree" else size, "budget": size if kind == "ddtree" else None,
            "tau_token_weighted": tau}


PROFILE = {"t_ar_ms": 20.0, "t_verify_ms": {"1": 20.0, "16": 24.0, "17": 24.5, "33": 26.0, "65": 40.0}}


def test_hand_computed_speedups_and_best_budget():
    methods = {"chain-B16": _method("chain", 16, 5.0), "ddtree-16": _method("ddtree", 16, 6.0),
               "ddtree-32": _method("ddtree", 32, 7.0), "ddtree-64": _method("ddtree", 64, 8.0),
               "ddtree-128": _method("ddtree", 128, 9.0)}
    section = model.speedup_section(methods, check_profile(PROFILE, "p.json"), "user", 6.0, "user")
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / (6 + 24))       # 3.333
    assert methods["ddtree-16"]["expected_speedup"] == pytest.approx(6 * 20 / (6 + 24.5))     # 3.934
    assert methods["ddtree-32"]["expected_speedup"] == pytest.approx(7 * 20 / (6 + 26))       # 4.375
    assert methods["ddtree-64"]["expected_speedup"] == pytest.approx(8 * 20 / (6 + 40))       # 3.478
    assert methods["ddtree-128"]["expected_speedup"] is None  # 129 tokens: outside the profile
    assert section["best_ddtree"] == {"method": "ddtree-32", "budget": 32, "expected_speedup": pytest.approx(4.375)}
    assert section["outside_profile"] == ["ddtree-128"] and section["estimate"] is True


def test_verify_time_is_linear_between_listed_sizes():
    profile = check_profile({"t_ar_ms": 1, "t_verify_ms": {"8": 10, "16": 14}}, "p.json")
    assert model.verify_ms(profile, 12) == pytest.approx(12.0)
    assert model.verify_ms(profile, 16) == 14.0
    assert model.verify_ms(profile, 4) is None and model.verify_ms(profile, 17) is None


def test_user_profile_wins_and_its_draft_time_is_used(tmp_path):
    measured = {**PROFILE, "t_ar_ms": 99.0, "device": "gpu"}
    (tmp_path / PROFILE_NAME).write_text(json.dumps(measured))
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({**PROFILE, "t_draft_ms": 6.0}))
    methods = {"chain-B16": _method("chain", 16, 5.0)}

    def never():
        raise AssertionError("the drafter must not be timed when the profile gives t_draft_ms")
    section = speedup.estimate({"speedup": {"profile": str(user)}}, tmp_path, methods, never)
    assert section["target_source"] == f"user profile {user}" and section["t_ar_ms"] == 20.0
    assert section["source"] == labels.USER == "user profile"
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)


def test_measured_profile_and_timed_drafter(tmp_path):
    (tmp_path / PROFILE_NAME).write_text(json.dumps({**PROFILE, "device": "cpu"}))
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    timing = {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0, "device": "cpu", "context_tokens": 100}
    section = speedup.estimate({"speedup": {}}, tmp_path, methods, lambda: timing)
    assert section["target_source"].startswith("measured at extraction on cpu") and section["t_draft_ms"] == 6.0
    assert section["source"] == labels.MEASURED == "measured by us"
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)


def test_no_profile_gives_no_estimate(tmp_path):
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    section = speedup.estimate({"speedup": {}}, tmp_path, methods, lambda: None)
    assert section["available"] is False and methods["chain-B16"]["expected_speedup"] is None
    assert section["source"] == "no profile"


def test_user_profile_without_draft_time_and_an_untimed_drafter_are_labelled(tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps(PROFILE))
    timing = {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0, "device": "cuda:0", "context_tokens": 100}
    section = speedup.estimate({"speedup": {"profile": str(user)}}, tmp_path, {"chain-B16": _method("chain", 16, 5.0)},
                               lambda: timing)
    assert section["source"] == "user profile; drafter step measured by us"
    (tmp_path / PROFILE_NAME).write_text(json.dumps(PROFILE))
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    section = speedup.estimate({"speedup": {}}, tmp_path, methods, lambda: None)  # speedup.measure false
    assert section["source"] == "no drafter step time" and methods["chain-B16"]["expected_speedup"] is None
