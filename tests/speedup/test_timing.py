"""Stable step timing, on a scripted clock: repeats until the median's 95% CI is within ±2%, a cap that says it
stopped, and the >5% warning between two measurements; the median CI against its exact binomial table."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from dflash_eval.speedup import timing
from dflash_eval.stats import median_ci


class Clock:
    """perf_counter for timing.py: each timed call advances it by the next scripted duration (ms)."""

    def __init__(self, durations_ms):
        self.now, self.durations, self.calls = 0.0, iter(durations_ms), 0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.calls += 1
        self.now += next(self.durations) / 1e3


@pytest.fixture
def clock(monkeypatch):
    def make(durations):
        fake = Clock(durations)
        monkeypatch.setattr(timing.time, "perf_counter", fake)
        return fake

    return make


def test_median_ci_is_the_exact_order_statistic_interval():
    assert median_ci(range(1, 6)) == (float("-inf"), float("inf"))  # n=5: no 95% interval exists
    assert median_ci(range(1, 7)) == (1.0, 6.0)  # n=6: x(1)..x(6), 96.9%
    assert median_ci(range(1, 11)) == (2.0, 9.0)  # n=10: x(2)..x(9), 97.9%
    assert median_ci(range(1, 101)) == (40.0, 61.0)  # n=100: the textbook x(40)..x(61)


def test_a_steady_step_stops_at_the_fewest_repeats_that_give_a_ci(clock):
    fake = clock(itertools.repeat(10.0))
    result = timing.timed_ms(fake.step, torch.device("cpu"), repeats=3, budget_s=60)
    assert result["stable"] and result["capped"] is None and result["ms"] == pytest.approx(10.0)
    assert result["repeats"] == timing.MIN_REPEATS and fake.calls == timing.MIN_REPEATS + 1  # + the warm-up


def test_a_noisy_step_repeats_until_its_median_is_within_two_percent(clock):
    # alternating 9 / 11 ms around a 10 ms median, with a few 30 ms outliers: the CI needs many repeats
    noisy = itertools.chain([50.0], itertools.cycle([9.0, 11.0, 10.0, 30.0, 10.0, 9.9, 10.1, 10.0]))
    fake = clock(noisy)
    result = timing.timed_ms(fake.step, torch.device("cpu"), repeats=3, budget_s=600)
    low, high = result["ci95_ms"]
    assert result["stable"] and result["repeats"] > timing.MIN_REPEATS
    assert result["ms"] - low <= 0.02 * result["ms"] and high - result["ms"] <= 0.02 * result["ms"]
    assert result["max_ms"] == 30.0  # the warm-up's 50 ms is not kept


def test_the_time_cap_stops_an_unstable_step_and_says_so(clock):
    fake = clock(itertools.cycle([5.0, 20.0]))  # bimodal: the median never settles within ±2%
    result = timing.timed_ms(fake.step, torch.device("cpu"), repeats=3, budget_s=1.0)
    assert not result["stable"] and result["capped"] == "time cap 1 s"
    assert result["repeats"] < 100


def test_two_measurements_more_than_five_percent_apart_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        same = timing.compare({"1": 10.0, "8": 12.0}, {"1": 10.4, "8": 11.5}, "profile p")
        assert same["agree"] and not caplog.text
        apart = timing.compare({"1": 10.0, "8": 12.0, "9": 12.0}, {"1": 10.0, "8": 12.0, "9": 13.0}, "profile p")
    assert not apart["agree"] and apart["beyond_5_percent"] == ["9"]
    assert apart["ratios"]["9"] == pytest.approx(13 / 12)
    assert "profile p: 1 of 3 sizes differ" in caplog.text and "worst: 9 tokens, 1.083x" in caplog.text
