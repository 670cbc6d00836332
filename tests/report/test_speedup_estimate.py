"""Expected speedup, made in the report from metrics.json and the target's profile: hand-computed cases, which
profile wins."""

import json

import pytest

from dflash_eval.cache.serving_profile import check_profile
from dflash_eval.report import speedup
from dflash_eval.speedup import labels, model


def _estimate(path, named_by_user, methods, timing):
    """The report's estimate from a profile file (the user's, or the profile_target rule's) and the drafter's
    timing as metrics.json holds it."""
    target, source, _stamp = speedup.load_target_profile(path, named_by_user)
    return speedup.estimate(methods, target, source, named_by_user, timing)


def _method(kind, size, tau):
    return {
        "kind": kind,
        "block_size": 16 if kind == "ddtree" else size,
        "budget": size if kind == "ddtree" else None,
        "tau_token_weighted": tau,
    }


PROFILE = {"t_ar_ms": 20.0, "t_verify_ms": {"1": 20.0, "16": 24.0, "17": 24.5, "33": 26.0, "65": 40.0}}


def test_hand_computed_speedups_and_best_budget():
    methods = {
        "chain-B16": _method("chain", 16, 5.0),
        "ddtree-16": _method("ddtree", 16, 6.0),
        "ddtree-32": _method("ddtree", 32, 7.0),
        "ddtree-64": _method("ddtree", 64, 8.0),
        "ddtree-128": _method("ddtree", 128, 9.0),
    }
    section = model.speedup_section(methods, check_profile(PROFILE, "p.json"), "user", 6.0, "user")
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / (6 + 24))  # 3.333
    assert methods["ddtree-16"]["expected_speedup"] == pytest.approx(6 * 20 / (6 + 24.5))  # 3.934
    assert methods["ddtree-32"]["expected_speedup"] == pytest.approx(7 * 20 / (6 + 26))  # 4.375
    assert methods["ddtree-64"]["expected_speedup"] == pytest.approx(8 * 20 / (6 + 40))  # 3.478
    assert methods["ddtree-128"]["expected_speedup"] is None  # 129 tokens: not in the profile
    assert section["best_ddtree"] == {"method": "ddtree-32", "budget": 32, "expected_speedup": pytest.approx(4.375)}
    assert (
        list(section["not_measured"]) == ["ddtree-128"]
        and "129 verified tokens" in section["not_measured"]["ddtree-128"]
        and section["estimate"] is True
    )
    assert section["ddtree_note"] is None  # the profile does not say the target is a hybrid


def test_only_measured_sizes_count_never_interpolated():
    """A staircase (vLLM's 27B hybrid: 53.8 ms for 8 tokens, 60.8 for 9): 12 between 8 and 16 is not a guess."""
    profile = check_profile({"t_ar_ms": 1, "t_verify_ms": {"8": 10, "16": 14}}, "p.json")
    assert model.verify_ms(profile, 16) == 14.0 and model.verify_ms(profile, 8) == 10.0
    assert model.verify_ms(profile, 12) is None and model.verify_ms(profile, 4) is None
    methods = {"chain-B12": _method("chain", 12, 4.0), "chain-B16": _method("chain", 16, 5.0)}
    section = model.speedup_section(methods, profile, "user", 2.0, "user")
    assert methods["chain-B12"]["expected_speedup"] is None and "chain-B12" in section["not_measured"]
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 1 / (2 + 14))


def test_drafter_step_per_block_and_a_block_not_timed():
    methods = {
        "chain-B8": _method("chain", 8, 4.0),
        "chain-B16": _method("chain", 16, 5.0),
        "chain-B4": _method("chain", 4, 3.0),
        "ddtree-16": _method("ddtree", 16, 6.0),
    }
    profile = check_profile({"t_ar_ms": 20, "t_verify_ms": {"4": 21, "8": 22, "16": 24, "17": 24.5}}, "p.json")
    section = model.speedup_section(methods, profile, "measured", {8: 3.0, 16: 5.0}, "timed")
    assert methods["chain-B8"]["expected_speedup"] == pytest.approx(4 * 20 / (3 + 22))
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / (5 + 24))
    assert methods["ddtree-16"]["expected_speedup"] == pytest.approx(6 * 20 / (5 + 24.5))  # drafts the own block 16
    assert methods["chain-B4"]["expected_speedup"] is None
    assert section["not_measured"]["chain-B4"].startswith("the drafter step at block 4 was not timed")


def test_a_tree_on_a_hybrid_target_says_what_it_assumes():
    methods = {"chain-B16": _method("chain", 16, 5.0), "ddtree-16": _method("ddtree", 16, 6.0)}
    profile = check_profile({**PROFILE, "hybrid": True}, "p.json")
    section = model.speedup_section(methods, profile, "measured", 6.0, "timed")
    assert section["ddtree_note"] == model.HYBRID_TREE_NOTE and "SGLang 0.5.23" in section["ddtree_note"]
    section = model.speedup_section({"chain-B16": _method("chain", 16, 5.0)}, profile, "measured", 6.0, "timed")
    assert section["ddtree_note"] is None  # no tree priced, nothing to say


def test_user_profile_wins_and_its_draft_time_is_used(tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({**PROFILE, "t_draft_ms": 6.0}))
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    timing = {"by_block": {16: {"ms": 99.0, "min_ms": 99.0, "max_ms": 99.0}}, "device": "cuda:0", "context_tokens": 100}
    section = _estimate(user, True, methods, timing)  # the profile's t_draft_ms wins over the drafter's timing
    assert section["target_source"] == f"user profile {user}" and section["t_ar_ms"] == 20.0
    assert section["source"] == labels.USER == "user profile" and "draft_timing" not in section
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)


def test_measured_profile_and_timed_drafter(tmp_path):
    measured = tmp_path / "cuda0-bfloat16-fla.json"
    measured.write_text(json.dumps({**PROFILE, "device": "cpu", "method": "graphs"}))
    methods = {"chain-B16": _method("chain", 16, 5.0), "ddtree-16": _method("ddtree", 16, 6.4)}
    timing = {
        "by_block": {16: {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0}},
        "by_budget": {16: {"ms": 7.0, "min_ms": 6.5, "max_ms": 8.0}},
        "device": "cpu",
        "context_tokens": 100,
        "method": "graphs",
    }
    section = _estimate(measured, False, methods, timing)
    assert "(graphs)" in section["draft_source"] and "two ways" not in section["draft_source"]
    assert section["target_source"] == f"measured by the profile_target rule on cpu, timed graphs ({measured})"
    assert section["t_draft_ms"] == {16: 6.0}
    assert "b16 6 (5..7)" in section["draft_source"] and "ddtree-16 7 (6.5..8)" in section["draft_source"]
    assert section["source"] == labels.MEASURED == "measured by us"
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)
    # the DDTree is priced at its own drafting step (top-N, read, tree build), not at the chain's block step
    assert methods["ddtree-16"]["expected_speedup"] == pytest.approx(6.4 * 20 / (7 + PROFILE["t_verify_ms"]["17"]))
    assert section["verify"]["ddtree-16"]["t_draft_ms"] == 7.0 and "t_draft_step" in section["verify"]["ddtree-16"]
    assert "t_draft_step" not in section["verify"]["chain-B16"]


def test_an_eager_target_profile_beside_a_graph_timed_drafter_says_so(tmp_path):
    measured = tmp_path / "p.json"
    measured.write_text(json.dumps({**PROFILE, "device": "H200", "method": "eager"}))
    timing = {
        "by_block": {16: {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0}},
        "device": "cuda:0",
        "context_tokens": 100,
        "method": "graphs",
    }
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    section = _estimate(measured, False, methods, timing)
    assert "the two terms were timed two ways" in section["draft_source"]
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)  # the same arithmetic


def test_no_profile_gives_no_estimate(tmp_path):
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    timing = {"by_block": {16: {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0}}, "device": "cuda:0", "context_tokens": 100}
    section = _estimate(None, False, methods, timing)
    assert section["available"] is False and methods["chain-B16"]["expected_speedup"] is None
    assert section["source"] == "no profile" and speedup.NOT_TIMED in section["why"]


def test_user_profile_without_draft_time_and_an_untimed_drafter_are_labelled(tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps(PROFILE))
    timing = {"by_block": {16: {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0}}, "device": "cuda:0", "context_tokens": 100}
    section = _estimate(user, True, {"chain-B16": _method("chain", 16, 5.0)}, timing)
    assert section["source"] == "user profile; drafter step measured by us"
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    section = _estimate(user, False, methods, None)  # speedup.measure false: no drafter timing in metrics.json
    assert section["source"] == "no drafter step time" and methods["chain-B16"]["expected_speedup"] is None


def test_a_whole_step_measured_on_the_users_server_is_used_as_is(tmp_path):
    """t_step_ms (draft + verify at block b, SGLANG_SIMULATE_ACC_LEN): tau x T_AR / T_step(b), no drafter timing."""
    user = tmp_path / "sglang.json"
    user.write_text(json.dumps({"t_ar_ms": 10.0, "t_verify_ms": {"1": 10.0}, "t_step_ms": {"16": 16.0}}))
    methods = {
        "chain-B16": _method("chain", 16, 5.0),
        "chain-B8": _method("chain", 8, 4.0),
        "ddtree-16": _method("ddtree", 16, 6.0),
    }
    section = _estimate(user, True, methods, None)
    assert methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 10 / 16)
    assert section["verify"]["chain-B16"]["t_step_ms"] == 16.0 and section["source"] == labels.USER
    assert methods["chain-B8"]["expected_speedup"] is None and methods["ddtree-16"]["expected_speedup"] is None
    assert set(section["not_measured"]) == {"chain-B8", "ddtree-16"}


def test_apply_replaces_the_evaluations_section_and_states_both_estimate_codes(tmp_path):
    """What the report does with each metrics.json: the estimate made, the chain's copy updated, the stamps of the
    evaluation's estimate code and the profile's named."""
    measured = tmp_path / "p.json"
    measured.write_text(json.dumps({**PROFILE, "device": "cpu", "method": "graphs", "estimate_code": "sha256:p"}))
    methods = {"chain-B16": _method("chain", 16, 5.0)}
    metrics = {
        "methods": methods,
        "chain": {**methods["chain-B16"], "method": "chain-B16"},
        "speedup": {
            "estimate": True,
            "estimate_code": {"evaluation": "sha256:e"},
            "draft_timing": {
                "by_block": {16: {"ms": 6.0, "min_ms": 5.0, "max_ms": 7.0}},
                "device": "cpu",
                "context_tokens": 100,
                "method": "graphs",
            },
        },
    }
    target, source, stamp = speedup.load_target_profile(measured, False)
    speedup.apply(metrics, target, source, False, stamp)
    assert metrics["speedup"]["estimate_code"] == {"evaluation": "sha256:e", "profile": "sha256:p"}
    assert (
        metrics["chain"]["expected_speedup"] == methods["chain-B16"]["expected_speedup"] == pytest.approx(5 * 20 / 30)
    )
    measured.write_text(json.dumps(PROFILE))  # a profile timed before stamps says so
    assert speedup.load_target_profile(measured, False)[2] == "unstamped (timed before stamps)"
