"""The online panel for vLLM records: counters by hand, both tau conventions, step-by-step equality, the rule."""

from __future__ import annotations

import pytest

from dflash_eval.demo.vllm_mode import spec_metrics
from dflash_eval.report import online

B = 4


def record(
    steps: list[int], *, detailed: bool = True, rule=("greedy", "standard"), last_raw: int = 0, max_tokens: int = 64
) -> dict:
    """A vLLM record whose verify steps produced `steps` (the last step's raw count raised by `last_raw`)."""
    spec = spec_metrics(steps, B - 1, detailed)
    if last_raw:
        spec["num_accepted_draft_tokens"] += last_raw
        spec["acceptance_histogram"][steps[-1] - 1] -= 1
        spec["acceptance_histogram"][steps[-1] - 1 + last_raw] += 1
        if detailed:
            spec["per_step_accepted"][-1] += last_raw
    return {
        "spec": {**spec, "engine": "vllm"},
        "usage": {"completion_tokens": 1 + sum(steps)},
        "request": {"max_tokens": max_tokens},
        "server": {
            "speculative": {
                "engine": "vllm",
                "speculative_num_draft_tokens": B,
                "draft_sample_method": rule[0],
                "rejection_sample_method": rule[1],
            }
        },
    }


def panel(records: dict[str, dict], offline: dict[str, list[int]]) -> dict:
    counters = {i: online.request_counters(r) for i, r in records.items()}
    return online.compare(
        {i: c for i, c in counters.items() if c is not None}, {f"chain-B{B}": offline}, B, 0.05, bootstrap=50
    )


def test_equal_step_by_step_in_both_conventions() -> None:
    steps = {"a": [3, 1, 4, 2], "b": [4, 4, 1]}
    out = panel({i: record(s) for i, s in steps.items()}, steps)
    assert out["compared"] and out["equal_requests"] == out["exact_requests"] == 2
    a = out["per_request"]["a"]
    assert a["online_tau"] == a["offline_tau"] == pytest.approx(10 / 4)  # ours: produced / steps
    assert a["online_mean_acceptance_length"] == pytest.approx(10 / 4)  # vLLM's: 1 + accepted / steps
    assert a["online_tau_sglang"] == pytest.approx(11 / 4)  # completion tokens / steps
    assert out["tau_vllm_definition"] == online.TAU_VLLM and a["drafted_full_blocks"]


def test_a_step_that_differs_is_not_equal_though_the_counts_are() -> None:
    """Same steps count, same totals, same histogram, two steps swapped: only the per-step arrays tell."""
    out = panel({"a": record([3, 1, 4, 2])}, {"a": [1, 3, 4, 2]})
    assert out["unequal_ids"] == ["a"]
    summary = panel({"a": record([3, 1, 4, 2], detailed=False)}, {"a": [1, 3, 4, 2]})
    assert summary["equal_requests"] == 1 and "summary" in summary["per_step_note"]


def test_the_last_steps_raw_count_is_tolerated_only_there() -> None:
    out = panel({"a": record([3, 1, 2], last_raw=1)}, {"a": [3, 1, 2]})
    assert out["equal_requests"] == 1 and out["exact_requests"] == 0


def test_another_rule_is_not_compared_and_says_why() -> None:
    out = panel({"a": record([3, 1], rule=("probabilistic", "standard"))}, {"a": [3, 1]})
    assert out["compared"] is False and "probabilistic" in out["why"]
    assert out["online_tau_mean_of_samples"] == pytest.approx(2.0)


def test_no_metrics_means_no_per_request_data_and_why() -> None:
    rec = {
        "spec": None,
        "spec_why": "the vLLM server runs --per-request-spec-decode-metrics none (the default)",
        "server": {"speculative": {"engine": "vllm"}},
        "usage": {"completion_tokens": 5},
    }
    out = panel({"a": rec}, {"a": [2, 2]})
    assert out["recorded"] is False and "no per-request data" in out["why"] and "none" in out["why"]
