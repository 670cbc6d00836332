"""The cache check at T > 0 (evaluate/sampled_check.py): a support share and an argmax floor, by hand, and a cache
of another model flagged on the real stage (tests/evaluate/test_rejection_stage.py builds it)."""

from __future__ import annotations

from dflash_eval.evaluate.sampled_check import check

SAMPLING = [{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}]


def _rejection(outside: int, read: int) -> dict:
    return {"outside_support": {"tokens": outside, "tokens_read": read, "share_of_tokens": outside / read}}


def test_greedy_completions_have_no_sampled_check():
    assert check(0.99, 500, None, None) is None


def test_the_served_model_passes_and_another_is_flagged():
    fine = check(0.40, 500, SAMPLING, _rejection(2, 500))
    assert fine["support_share"] == 1 - 2 / 500 and fine["argmax_floor"] == 1 / 20 and fine["suspect"] == []
    other = check(0.004, 500, SAMPLING, _rejection(300, 500))  # another model: outside its support, argmax ~1/V
    assert len(other["suspect"]) == 2 and "40.0% of the completion tokens read" in other["suspect"][0]
    assert "under half of 5.0%" in other["suspect"][1]


def test_without_top_k_or_log_probs_there_is_less_to_check():
    off = check(0.001, 500, [{**SAMPLING[0], "top_k": -1}], None)
    assert off["argmax_floor"] is None and off["support_share"] is None and off["suspect"] == []
    few = check(0.001, 50, SAMPLING, None)  # under MIN_TOKENS: the agreement is not read
    assert few["suspect"] == []
