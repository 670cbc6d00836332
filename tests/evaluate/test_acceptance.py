"""Hand-computed cases for the trajectory replay, the tau conventions and the statistics."""

import math

import numpy as np
import pytest

from dflash_eval import stats as S
from dflash_eval.evaluate import acceptance as A


def test_tau_conventions_by_hand():
    # sample 1: steps 1, 3 -> mean 2.0; sample 2: steps 4, 4, 4, 4 -> mean 4.0
    stats = S.tau_stats([[1, 3], [4, 4, 4, 4]])
    assert stats["tau_mean_of_samples"] == pytest.approx(3.0)  # (2 + 4) / 2
    assert stats["tau_token_weighted"] == pytest.approx(20 / 6)  # 20 tokens / 6 steps
    assert (stats["samples"], stats["steps"], stats["tokens"]) == (2, 6, 20)


def test_empty_samples_are_left_out_and_nothing_is_nan():
    stats = S.tau_stats([[], [2, 2]])
    assert stats["samples"] == 1 and stats["tau_mean_of_samples"] == 2.0
    assert math.isnan(S.tau_stats([])["tau_mean_of_samples"])


def test_chain_steps_budget_and_stop():
    # prompt_len 2, 8 tokens in all; anchors 2..6 matched 3, 0, 1, 5, 0; no stop, budget = end
    limits = A.SequenceLimits(prompt_len=2, total_len=8, max_length=8)
    accepted = [3, 0, 1, 5, 0]
    # start 2: produce min(3+1, 8-2-1=5) = 4 -> start 6; produce min(0+1, 1) = 1 -> start 7 = max_length - 1
    assert A.chain_steps(accepted, limits, [False] * 8) == [4, 1]
    stop = [False] * 8
    stop[4] = True  # a stop token among the first step's tokens ends it there
    assert A.chain_steps(accepted, limits, stop) == [2]
    stop = [False] * 8
    stop[2] = True  # the prefill token itself is a stop token: no verification step at all
    assert A.chain_steps(accepted, limits, stop) == []


def test_verify_sizes_shrink_at_the_budget():
    limits = A.SequenceLimits(prompt_len=3, total_len=10, max_length=10)
    assert A.verify_sizes(limits, 4).tolist() == [4, 4, 4, 4, 3, 2]  # anchors 3..8: min(4, 10 - s)


def test_paired_difference_by_hand_and_verdicts():
    a = {"x": [3, 3], "y": [2], "z": [5]}
    b = {"x": [1, 1], "y": [2], "w": [9]}
    result = S.paired_difference(a, b, n_boot=200, seed=0)
    assert result["samples"] == 2  # x and y only
    assert result["tau_mean_of_samples"]["difference"] == pytest.approx((3 + 2) / 2 - (1 + 2) / 2)
    assert result["tau_token_weighted"]["difference"] == pytest.approx(8 / 3 - 4 / 3)
    low, high = result["tau_mean_of_samples"]["ci95"]
    assert 0 <= low <= high <= 2  # per-sample differences are 2 and 0
    assert S.verdict([0.1, 0.5]) == "better" and S.verdict([-0.5, -0.1]) == "worse"
    assert S.verdict([-0.1, 0.1]) == "no clear difference" and S.verdict([math.nan] * 2) == "undetermined"


def test_identical_drafters_have_a_zero_width_paired_interval():
    steps = {str(i): list(np.random.default_rng(i).integers(1, 9, size=7)) for i in range(20)}
    result = S.paired_difference(steps, steps, n_boot=100, seed=1)
    assert result["tau_mean_of_samples"]["ci95"] == [0.0, 0.0]


def test_bootstrap_ci_brackets_the_estimate():
    per_sample = [list(np.random.default_rng(i).integers(1, 6, size=10)) for i in range(30)]
    ci = S.bootstrap_ci(per_sample, 500, 0)["tau_mean_of_samples"]
    assert ci[0] < S.tau_stats(per_sample)["tau_mean_of_samples"] < ci[1]
