"""The speculation profile against hand-counted rates, Model-Optimizer's own worked example and its metrics.json."""

from __future__ import annotations

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.stage import samples_csv
from dflash_eval.report import speculation_profile as sp

SETTINGS = {"context_buckets": [8, 16], "bootstrap": 200, "seed": 0}


def counted(per_sample: list[list[int]], depth: int) -> tuple[list, list]:
    """The two rates by plain counting: steps whose length reaches k + 1, over all steps / over those reaching k."""
    lengths = [n for steps in per_sample for n in steps]
    marginal = [sum(n >= k + 1 for n in lengths) / len(lengths) for k in range(1, depth)]
    conditional = []
    for k in range(1, depth):
        reached = sum(n >= k for n in lengths)
        conditional.append(sum(n >= k + 1 for n in lengths) / reached if reached else None)
    return marginal, conditional


def test_model_optimizers_worked_example():
    """Model-Optimizer PR #2247's test: 100 steps of lengths 1/2/3 = 40/30/30, K = 3: marginal [0.6, 0.3, 0.0],
    conditional [0.6, 0.5, 0.0], mean 1.9 = 1 + sum(marginal)."""
    steps = [[1] * 40 + [2] * 30 + [3] * 30]
    samples = [sp.SampleSteps("a", 5, tuple(steps[0]))]
    numbers = sp.rates(samples, 4, 0, 0, sampled=False)
    assert numbers["marginal_accept_rates"] == pytest.approx([0.6, 0.3, 0.0])
    assert numbers["conditional_accept_rates"] == pytest.approx([0.6, 0.5, 0.0])
    assert numbers["mean_accept_length"] == pytest.approx(1.9)
    assert numbers["validation"]["mean_consistency"] == {
        "implied_mean_accept_length": pytest.approx(1.9),
        "passed": True,
    }
    assert numbers["acceptance_length_histogram"] == {"1": 40, "2": 30, "3": 30, "4": 0}


def test_a_position_no_step_reached_has_no_conditional_rate():
    numbers = sp.rates([sp.SampleSteps("a", 1, (1, 2, 1))], 4, 0, 0, sampled=False)
    assert numbers["marginal_accept_rates"] == pytest.approx([1 / 3, 0.0, 0.0])
    assert numbers["conditional_accept_rates"][:2] == pytest.approx([1 / 3, 0.0])
    assert numbers["conditional_accept_rates"][2] is None


def test_contexts_are_the_prompt_and_what_the_earlier_steps_produced():
    assert sp.SampleSteps("a", 10, (3, 1, 4)).contexts() == [10, 13, 14]


def _evaluation(tmp_path, per_sample: dict[str, tuple[int, list[int]]], block: int = 4):
    """samples.csv as the evaluate stage writes it, and the metrics.json numbers that go with it."""
    from dflash_eval import stats

    rows = [
        {
            "id": i,
            "method": "chain-B4",
            "prompt_tokens": prompt,
            "completion_tokens": sum(steps) + 1,
            "steps": len(steps),
            "tokens": sum(steps),
            "tau": sum(steps) / len(steps),
            "acceptance_lengths": " ".join(map(str, steps)),
        }
        for i, (prompt, steps) in per_sample.items()
    ]
    path = tmp_path / "samples.csv"
    path.write_text(samples_csv(rows))
    lists = [steps for _prompt, steps in per_sample.values()]
    chain = {**stats.tau_stats(lists), "ci95": stats.bootstrap_ci(lists, 200, 0)}
    metrics = {
        "drafter": "d",
        "dataset": "x",
        "block_size": block,
        "layer_ids": [1],
        "checkpoint": {"path": "/c", "layout": "hf", "sha256": "ab" * 32, "global_step": 7},
        "cache": {"target_config_hash": "cd" * 32, "backend": "torch"},
        "dtype": "float32",
        "sampling": None,
        "methods": {"chain-B4": chain},
    }
    return metrics, path


PER_SAMPLE = {"a": (5, [4, 1, 2, 4, 3]), "b": (12, [1, 1, 2]), "c": (3, [4, 4, 4, 2, 1, 1])}


def test_profile_rates_agree_with_samples_csv_and_split_by_context(tmp_path):
    metrics, path = _evaluation(tmp_path, PER_SAMPLE)
    profile = sp.build(metrics, sp.read_samples(path), SETTINGS, None, "metrics.json")
    chain = profile["profiles"]["chain-B4"]
    marginal, conditional = counted([steps for _p, steps in PER_SAMPLE.values()], 4)
    assert chain["marginal_accept_rates"] == pytest.approx(marginal)
    assert chain["conditional_accept_rates"] == pytest.approx(conditional)
    assert (chain["num_samples"], chain["num_steps"], chain["num_tokens"]) == (3, 14, 34)
    assert chain["mean_accept_length"] == pytest.approx(34 / 14)
    assert chain["mean_accept_length_ci95"] == metrics["methods"]["chain-B4"]["ci95"]["tau_token_weighted"]
    assert chain["num_speculative_tokens"] == 3 and chain["verification_method"] == "longest_prefix"
    # contexts: a 5 9 10 12 16 | b 12 13 14 | c 3 7 11 15 17 18 -> [0, 8): a5 c3 c7; [8, 16): a9 a10 a12 b* c11 c15
    buckets = {tuple(b["context_tokens"]): b for b in chain["by_context_length"]}
    assert list(buckets) == [(0, 8), (8, 16), (16, None)]
    assert buckets[(0, 8)]["acceptance_length_histogram"] == {"1": 0, "2": 0, "3": 0, "4": 3}
    expected_mid = [1, 2, 4, 1, 1, 2, 4, 2]
    assert buckets[(8, 16)]["num_steps"] == len(expected_mid)
    assert buckets[(8, 16)]["marginal_accept_rates"] == pytest.approx(counted([expected_mid], 4)[0])
    assert buckets[(16, None)]["num_steps"] == 3 and buckets[(16, None)]["num_samples"] == 2
    assert sum(b["num_steps"] for b in buckets.values()) == chain["num_steps"]


def test_a_samples_csv_of_another_evaluation_is_refused(tmp_path):
    metrics, path = _evaluation(tmp_path, PER_SAMPLE)
    metrics["methods"]["chain-B4"]["steps"] += 1
    with pytest.raises(DflashEvalError, match="chain-B4's steps is 15 in metrics.json but 14 from samples.csv"):
        sp.build(metrics, sp.read_samples(path), SETTINGS, None, "metrics.json")


def test_bad_buckets_are_named():
    with pytest.raises(DflashEvalError, match="report.context_buckets must be ascending"):
        sp.bucket_edges([16, 8])
