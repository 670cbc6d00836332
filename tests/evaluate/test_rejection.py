"""The rejection scheme's step chain against brute-force enumeration of dflash_generate's own mechanics.

On a vocabulary of three tokens (one a stop token), blocks of 2, 3 and 4 tokens (the drafter's own block and
the shorter chains dflash_generate runs with a smaller block_size, whose drafts are their own) and a budget of 5
new tokens, every run of
the loop is enumerated with its exact probability: the drafts sampled from q, each accepted with
min(1, p/q) in turn, the residual (p - q)+ after a rejection (p itself when it is empty), the bonus token
from p, the token budget's cap and the stop token's cut, exactly as `dflash.model.dflash_generate` and
`_rejection_sample` run them. Conditioning on each output path gives the step count's distribution, which
must equal `step_distribution` on that path (to float rounding), and the path's probability must be the
target's (the loop is lossless). q may put zero mass on tokens, p too (as top-k / top-p do).
"""

from __future__ import annotations

import itertools
import zlib
from collections import defaultdict

import numpy as np
import pytest

from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.rejection import (
    StepDistribution,
    expected_token_weighted,
    step_distribution,
)

V, STOP, BLOCK, MAX_NEW = 3, 2, 3, 5


def _dist(key: tuple, salt: int, zero_some: bool) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr((key, salt)).encode()))
    weights = rng.random(V) ** 2
    if zero_some and rng.random() < 0.3:
        weights[rng.integers(V)] = 0.0
    return weights / weights.sum()


def p_target(prefix: tuple) -> np.ndarray:
    """The target's (tempered, renormalised) next-token distribution after `prefix`."""
    return _dist(prefix, 0, zero_some=True)


def q_draft(context: tuple, position: int, block: int = BLOCK) -> np.ndarray:
    """The drafter's distribution at block position `position` of the `block`-token block anchored after `context`
    (parallel: it does not depend on the other drafts; a shorter block drafts differently)."""
    return _dist((context, position, block), 1, zero_some=True)


def _block_outcomes(output: tuple, gamma: int, block: int):
    """(tokens written after the anchor, accepted drafts, probability) of one verification step."""
    for drafts in itertools.product(range(V), repeat=gamma):
        qs = [q_draft(output, j + 1, block) for j in range(gamma)]
        prob = float(np.prod([qs[j][d] for j, d in enumerate(drafts)]))
        if prob == 0:
            continue
        survive = prob
        for j, d in enumerate(drafts):
            p = p_target(output + drafts[:j])
            accept = min(1.0, p[d] / qs[j][d])
            residual = np.clip(p - qs[j], 0, None)
            residual = residual / residual.sum() if residual.sum() > 0 else p
            for token in range(V):
                if survive * (1 - accept) * residual[token] > 0:
                    yield drafts[:j] + (token,), j, survive * (1 - accept) * residual[token]
            survive *= accept
            if survive == 0:
                break
        else:
            bonus = p_target(output + drafts)
            for token in range(V):
                if survive * bonus[token] > 0:
                    yield drafts + (token,), gamma, survive * bonus[token]


def enumerate_runs(prompt: tuple, block: int = BLOCK) -> dict[tuple, dict[int, float]]:
    """output path -> steps -> joint probability, over every run of the loop."""
    runs: dict[tuple, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    max_length = len(prompt) + MAX_NEW

    def run(output: tuple, steps: int, prob: float, stopped: bool) -> None:
        start = len(output) - 1
        if not (start + 1 < max_length) or stopped:
            runs[output[:max_length]][steps] += prob
            return
        verify = min(block, max_length - start)
        for written, accepted, p in _block_outcomes(output, verify - 1, block):
            produced, stop = min(accepted + 1, max_length - start - 1), False
            for offset in range(produced):
                if written[offset] == STOP:
                    produced, stop = offset + 1, True
                    break
            run(output + written[:produced], steps + 1, prob * p, stop)

    first = p_target(prompt)
    for token in range(V):
        if first[token] > 0:
            run(prompt + (token,), 0, float(first[token]), token == STOP)
    return runs


def offline(path: tuple, prompt_len: int, block: int = BLOCK) -> StepDistribution:
    limits = sequence_limits(prompt_len, len(path), MAX_NEW, path[-1] == STOP)
    alpha = np.ones((max(0, len(path) - 1 - prompt_len), block - 1))
    for i in range(alpha.shape[0]):
        anchor = prompt_len + i
        for j in range(1, block):
            if anchor + j < len(path):
                token = path[anchor + j]
                q, p = q_draft(path[: anchor + 1], j, block)[token], p_target(path[: anchor + j])[token]
                alpha[i, j - 1] = min(1.0, q / p)
    return step_distribution(alpha, limits, [t == STOP for t in path], block)


@pytest.mark.parametrize("block", [2, BLOCK, 4])
@pytest.mark.parametrize("prompt", [(0, 1), (1, 0), (0, 0)])
def test_step_distribution_equals_brute_force(prompt, block):
    runs = enumerate_runs(prompt, block)
    assert sum(sum(by_steps.values()) for by_steps in runs.values()) == pytest.approx(1.0, abs=1e-12)
    assert any(p[-1] == STOP for p in runs) and any(len(p) == len(prompt) + MAX_NEW for p in runs)
    checked = 0
    for path, by_steps in runs.items():
        total = sum(by_steps.values())
        lossless = np.prod([p_target(path[:t])[path[t]] for t in range(len(prompt), len(path))])
        assert total == pytest.approx(lossless, rel=1e-9), path  # the output is distributed as the target's
        mine = offline(path, len(prompt), block)
        brute = np.zeros(len(mine.steps_pmf))
        for steps, prob in by_steps.items():
            brute[steps] = prob / total
        np.testing.assert_allclose(mine.steps_pmf, brute, rtol=1e-9, atol=1e-12, err_msg=str(path))
        tokens = len(path) - 1 - len(prompt)
        assert mine.tokens == tokens
        if tokens:
            brute_tau = sum(prob / total * tokens / steps for steps, prob in by_steps.items())
            assert mine.expected_tau == pytest.approx(brute_tau, rel=1e-9)
        checked += 1
    assert checked == len(runs)


def test_expected_histogram_counts_steps_by_length():
    """Expected steps producing m tokens, summed over m, is E[S]; weighted by m it is N."""
    for path in enumerate_runs((0, 1)):
        mine = offline(path, 2)
        assert mine.produced.sum() == pytest.approx(mine.expected_steps, rel=1e-12)
        assert np.dot(np.arange(1, BLOCK + 1), mine.produced) == pytest.approx(mine.tokens, rel=1e-12)


def test_hand_computed_chain():
    """Four tokens after the anchor, block 3, no stop: from anchor 0, alpha = (0.5, 0.25)."""
    limits = sequence_limits(0, 5, None, False)  # max_length 5: the chain ends at position 4, N = 4
    alpha = np.array([[0.5, 0.25], [1.0, 1.0], [0.0, 1.0], [0.5, 1.0]])
    # from 0: 1 token (p 0.5) -> 1; 2 (0.375) -> 2; 3 (0.125) -> 3. From 1: 3 tokens -> 4 (block full, bonus).
    # from 2: 1 token -> 3. From 3: the budget leaves one token -> 4.
    # S: path 0-1-4 (0.5): 2 steps; 0-2-3-4 (0.375): 3 steps; 0-3-4 (0.125): 2 steps.
    dist = step_distribution(alpha, limits, [False] * 5, 3)
    np.testing.assert_allclose(dist.steps_pmf, [0, 0, 0.625, 0.375, 0])
    assert dist.expected_tau == pytest.approx(0.625 * 2 + 0.375 * 4 / 3)


def test_token_weighted_is_the_exact_expectation_of_the_ratio():
    """E[(N1 + N2) / (S1 + S2)] for two independent samples, by enumeration, against the convolution."""
    a = StepDistribution(4, np.array([0, 0, 0.625, 0.375, 0]), np.zeros(3))
    b = StepDistribution(3, np.array([0, 0.2, 0.3, 0.5]), np.zeros(3))
    brute = sum(
        pa * pb * 7 / (sa + sb) for sa, pa in enumerate(a.steps_pmf) for sb, pb in enumerate(b.steps_pmf) if pa * pb
    )
    assert expected_token_weighted([a, b]) == pytest.approx(brute, rel=1e-12)
    assert expected_token_weighted([StepDistribution(0, np.ones(1), np.zeros(3))]) != expected_token_weighted([a])
