"""Online vs offline, like for like: hand-computed cases of report.online."""

from __future__ import annotations

import pytest

from dflash_eval.report import online, served_drafter


def record(verify_ct: int, completion_tokens: int, correct: int, histogram: list[int], block: int = 4) -> dict:
    return {
        "usage": {"completion_tokens": completion_tokens},
        "server": {"speculative": {"speculative_num_draft_tokens": block}},
        "spec": {
            "spec_verify_ct": verify_ct,
            "spec_accept_length": completion_tokens / verify_ct,
            "spec_num_correct_drafts": correct,
            "spec_correct_drafts_histogram": histogram,
        },
    }


def test_a_request_equal_to_the_offline_steps_in_both_conventions():
    # steps 3, 1, 4 after the prefill token: 1 + 8 = 9 completion tokens; drafts accepted 2, 0, 3 = 5
    counters = online.request_counters(record(3, 9, 5, [1, 0, 1, 1]))
    result = online.compare_request(counters, [3, 1, 4], block_size=4)
    assert result["exact"] and result["equal"]
    assert result["online_tau"] == result["offline_tau"] == 8 / 3  # ours: 8 tokens over 3 steps
    assert result["online_tau_sglang"] == result["offline_tau_sglang"] == 3.0  # SGLang's: 9 / 3
    assert result["online_tau_sglang"] - result["online_tau"] == pytest.approx(1 / 3)  # exactly 1/steps


def test_a_last_step_cut_at_max_tokens_is_equal_but_not_exact():
    # offline the last step produced 1 token (max_tokens reached); SGLang's verify accepted 2 drafts there
    counters = online.request_counters(record(3, 9, 7, [0, 0, 1, 2]))
    result = online.compare_request(counters, [3, 4, 1], block_size=4)
    assert result["equal"] and not result["exact"]
    assert (result["online_correct_drafts"], result["offline_correct_drafts"]) == (7, 5)
    assert result["offline_histogram"] == [1, 0, 1, 1]


@pytest.mark.parametrize(
    ("counters", "why"),
    [
        ((4, 9, 5, [2, 0, 1, 1]), "another step count"),
        ((3, 10, 6, [1, 0, 0, 2]), "another completion length"),
        ((3, 9, 4, [1, 1, 1]), "fewer accepted drafts than offline"),
        ((3, 9, 9, [1, 0, 1, 1]), "more surplus than one last step can hold"),
        ((3, 9, 6, [1, 1, 0, 1]), "a histogram with a step moved downwards"),
    ],
)
def test_requests_that_differ_are_not_equal(counters, why):
    result = online.compare_request(online.request_counters(record(*counters)), [3, 1, 4], block_size=4)
    assert not result["equal"], why


def test_pooled_comparison_paired_ci_and_flag():
    # a: equal ([3, 1, 4]); b: online 2 steps for 1 + 6 tokens (tau 3.0) against offline [2, 2, 2] (tau 2.0)
    records = {
        "a": online.request_counters(record(3, 9, 5, [1, 0, 1, 1])),
        "b": online.request_counters(record(2, 7, 4, [0, 0, 2])),
    }
    steps = {"chain-B4": {"a": [3, 1, 4], "b": [2, 2, 2]}, "chain-B2": {"a": [1], "b": [1]}}
    result = online.compare(records, steps, own_block=8, tolerance=0.05, bootstrap=200, seed=0)
    assert result["method"] == "chain-B4"  # the served block size from the records, not the drafter's own 8
    assert result["online_tau_compared"] == pytest.approx((8 / 3 + 3.0) / 2)
    assert result["offline_tau_compared"] == pytest.approx((8 / 3 + 2.0) / 2)
    assert result["paired_difference"]["difference"] == pytest.approx(0.5)
    low, high = result["paired_difference"]["ci95"]
    assert 0.0 <= low <= 0.5 <= high <= 1.0  # resampling {0, 1} differences
    assert result["online_tau_token_weighted"] == pytest.approx(14 / 5)
    assert result["offline_tau_token_weighted"] == pytest.approx(14 / 6)
    assert result["equal_requests"] == 1 and result["unequal_ids"] == ["b"]
    assert result["relative_difference"] == pytest.approx(0.5 / ((8 / 3 + 2.0) / 2)) and result["beyond_tolerance"]


def test_not_compared_says_why():
    records = {"a": online.request_counters(record(3, 9, 5, [1, 0, 1, 1], block=3))}
    result = online.compare(records, {"chain-B4": {"a": [3, 1, 4]}}, own_block=4, tolerance=0.05)
    assert not result["compared"] and "chain-B3" in result["why"]
    assert online.compare({}, None, 4, 0.05) == {**online.compare({}, None, 4, 0.05), "recorded": False}
    assert online.request_counters({"spec": None}) is None


# ----- the served drafter -----

SERVED = {
    "speculative_algorithm": "DFLASH",
    "speculative_draft_model_path": "/srv/step-1000",
    "speculative_num_draft_tokens": 4,
}
CHECKPOINT = {"path": "/ckpt/step-1000", "sha256": "ab" * 32}


def never_hashed(path: str, checkpoint: dict) -> str:
    raise AssertionError(f"{path} is not readable here: nothing to hash")


def test_a_served_drafter_of_the_same_name_not_readable_here_is_unverified():
    check = served_drafter.check_served_drafter([SERVED], CHECKPOINT, 4, allowed=False, differ=never_hashed)
    assert (check["status"], check["refused"], check["problems"]) == ("unverified", False, [])
    assert "weights unverified" in check["notes"][0]


@pytest.mark.parametrize(
    ("served", "says"),
    [
        ({**SERVED, "speculative_draft_model_path": "/srv/step-2000"}, "not /ckpt/step-1000 (not readable here"),
        ({**SERVED, "speculative_algorithm": "EAGLE"}, "speculates with 'EAGLE', not DFLASH"),
        ({**SERVED, "speculative_draft_model_path": None}, "reports no speculative_draft_model_path"),
    ],
)
def test_another_served_drafter_is_a_mismatch_that_refuses_unless_allowed(served, says):
    check = served_drafter.check_served_drafter([served], CHECKPOINT, 4, allowed=False, differ=never_hashed)
    assert check["status"] == "mismatch" and check["refused"] and says in check["problems"][0]
    allowed = served_drafter.check_served_drafter([served], CHECKPOINT, 4, allowed=True, differ=never_hashed)
    assert allowed["status"] == "mismatch" and not allowed["refused"]


def test_readable_served_weights_are_compared_by_sha256_then_by_tensors(tmp_path, monkeypatch):
    """The served path is hashed as evaluate hashes a checkpoint (hashlib's digest of the file); where that
    differs, the same tensors in another layout (.pt against a safetensors export) still verify."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)  # the fingerprint cache (.snakemake/) goes here, not into the checkout
    tensors = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "norm.weight": torch.ones(3)}
    served = tmp_path / "served.safetensors"
    save_file(tensors, str(served))
    digest = hashlib.sha256(served.read_bytes()).hexdigest()
    setting = {**SERVED, "speculative_draft_model_path": str(served)}
    same = served_drafter.check_served_drafter([setting], {"path": "/elsewhere/x", "sha256": digest}, 4, allowed=False)
    assert same["status"] == "verified" and not same["problems"]  # another path, the same bytes
    other = served_drafter.check_served_drafter([setting], CHECKPOINT, 4, allowed=False)
    assert other["refused"] and f"(sha256 {digest[:12]}) are not /ckpt/step-1000's" in other["problems"][0]
    pt = tmp_path / "step.pt"
    torch.save({"model": {f"model.{k}": v for k, v in tensors.items()}}, pt)
    exported = {"path": str(pt), "sha256": hashlib.sha256(pt.read_bytes()).hexdigest()}
    assert served_drafter.check_served_drafter([setting], exported, 4, allowed=False)["status"] == "verified"
    torch.save({"model": {**tensors, "norm.weight": torch.zeros(3)}}, pt)
    changed = {"path": str(pt), "sha256": hashlib.sha256(pt.read_bytes()).hexdigest()}
    check = served_drafter.check_served_drafter([setting], changed, 4, allowed=False)
    assert check["refused"] and "their tensors differ" in check["problems"][0]


def test_another_served_block_is_a_note_and_several_settings_a_mismatch():
    check = served_drafter.check_served_drafter(
        [{**SERVED, "speculative_num_draft_tokens": 8}], CHECKPOINT, 4, allowed=False, differ=never_hashed
    )
    assert check["status"] == "unverified" and "served at block 8, the drafter's own is 4" in check["notes"]
    two = served_drafter.check_served_drafter(
        [SERVED, {**SERVED, "speculative_num_draft_tokens": 8}], CHECKPOINT, 4, allowed=False, differ=never_hashed
    )
    assert two["refused"] and "2 different speculative settings" in two["problems"][0]
    assert served_drafter.check_served_drafter([], CHECKPOINT, 4, allowed=False)["status"] == "unverified"


# ----- the max_tokens tail -----


def tail_counters(verify_ct: int, correct: int, histogram: list[int], max_tokens: int | None = 8) -> dict:
    counters = online.request_counters(record(verify_ct, 8, correct, histogram))
    return {**counters, "max_tokens": max_tokens}


def test_the_first_block_max_tokens_shortened():
    # max_tokens 8, B 4: a step verifies min(4, 8 - generated + 1) tokens; generated 1, 4, 6 before the steps
    assert online.shortened_from([3, 2, 2], 4, 8) == 2  # 8 - 6 + 1 = 3 < 4
    assert online.shortened_from([3, 4], 4, 8) is None  # 8 - 4 + 1 = 5: both blocks full
    assert online.shortened_from([3, 2, 2], 4, None) is None  # max_tokens unknown: no tail rule


@pytest.mark.parametrize(
    ("counters", "equal"),
    [
        ((3, 6, [0, 1, 1, 1]), True),  # full tail block accepted 3 drafts, 2 tokens kept: one step, as offline
        ((4, 5, [1, 1, 1, 1]), True),  # the full block drafted worse: two tail steps (1 + 3 raw) for 2 tokens left
        ((5, 4, [3, 1, 1]), False),  # three tail steps for 2 tokens left: each step makes at least one token
        ((3, 9, [0, 0, 1, 2]), False),  # tail drafts 6 > one step x (B - 1)
        ((4, 5, [2, 0, 1, 1]), False),  # the head's histogram ([0, 1, 1]: steps 3, 2) is not kept
    ],
)
def test_a_shortened_tail_is_judged_by_what_full_blocks_allow(counters, equal):
    """Offline steps 3, 2, 2 for 8 tokens (1 from prefill): the third block was shortened to 3 tokens."""
    result = online.compare_request(tail_counters(*counters), [3, 2, 2], block_size=4)
    assert result["tail_shortened_from_step"] == 2 and result["equal"] is equal


def test_without_max_tokens_another_step_count_is_unequal():
    result = online.compare_request(tail_counters(4, 5, [1, 1, 1, 1], max_tokens=None), [3, 2, 2], block_size=4)
    assert result["tail_shortened_from_step"] is None and not result["equal"]


def test_a_sampled_datasets_interval_resamples_prompts_not_draws():
    """The n draws of one prompt (`<id>#s<k>`) are one cluster in the online-offline interval."""
    from dflash_eval.stats import paired_difference

    equal, longer = record(3, 9, 5, [1, 0, 1, 1]), record(2, 7, 4, [0, 0, 2])  # tau 8/3 each; 3.0 against 2.0
    records = {
        f"{prompt}#s{k}": online.request_counters(equal if prompt == "p" else longer)
        for prompt in ("p", "q", "r")
        for k in range(3)
    }
    offline = {i: ([3, 1, 4] if i.startswith("p") else [2, 2, 2]) for i in records}
    steps = {"chain-B4": offline}

    clustered = online.compare(records, steps, own_block=4, tolerance=0.05, bootstrap=400, seed=3, sampled=True)
    by_record = online.compare(records, steps, own_block=4, tolerance=0.05, bootstrap=400, seed=3)

    ids = sorted(records)
    pseudo = {i: online._pseudo_steps(records[i]["completion_tokens"] - 1, records[i]["verify_ct"]) for i in ids}
    expected = paired_difference(pseudo, offline, 400, 3, clusters={i: i.split("#")[0] for i in ids})
    assert clustered["paired_difference"] == expected["tau_mean_of_samples"]
    assert clustered["paired_difference"]["ci95"] != by_record["paired_difference"]["ci95"]
    assert clustered["paired_difference"]["difference"] == by_record["paired_difference"]["difference"]
