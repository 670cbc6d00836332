"""The rejection scheme against the live loop: `dflash.model.dflash_generate(temperature=T, top_p, top_k)` over
many seeds on tiny models (a hybrid Qwen3.5 target, a briefly trained DFlash drafter), each seed's realised
acceptance against offline's exact expectation given that seed's own output.

Given its output path, a run's realised tau has conditional mean E_i (offline's expected tau on that path) and
variance V_i (from the same step-count distribution); the seeds are independent. So
Z = sum_i (tau_i - E_i) / sqrt(sum_i V_i) has mean 0 and variance 1 exactly, and is close to normal for this
many runs: the test asks |Z| < 4 (a correct evaluator fails it about once in 15,000 runs; by Chebyshev, at
worst once in 16). Each run's realised step count must also have positive probability offline (exact).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_eval.cache.sampling import SamplingParams, token_logprobs
from dflash_eval.demo.reference import run_reference_loop
from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.rejection import anchor_alpha, step_distribution
from tests.support.tiny import (
    MASK_ID,
    greedy_sequences,
    tiny_drafter,
    tiny_target,
    train_briefly,
)

EOS, MAX_NEW, LAYERS, BLOCK, SEEDS = 1, 24, [0, 2], 4, 24
PARAMS = [SamplingParams(0.7, 1.0, -1), SamplingParams(1.0, 0.9, 40)]


def _forward(target, tokens):
    with torch.no_grad():
        out = target(tokens[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1), out.logits[0]


@pytest.fixture(scope="module")
def models():
    target = tiny_target(seed=0)
    prompts, sequences = greedy_sequences(target, [8 + i for i in range(4)], LAYERS, MAX_NEW, EOS)
    drafter = tiny_drafter(LAYERS, block_size=BLOCK, window=5)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    train_briefly(drafter, runner, sequences, steps=60)
    return target, drafter, runner, [p.tolist() for p in prompts[:2]]


def _offline(target, runner, ids: list[int], prompt_len: int, params: SamplingParams):
    tokens = torch.tensor(ids)
    features, logits = _forward(target, tokens)
    logp = torch.full((len(ids),), float("nan"))
    logp[1:] = token_logprobs(logits[:-1], tokens[1:], params)
    limits = sequence_limits(prompt_len, len(ids), MAX_NEW, ids[-1] == EOS)
    alpha = anchor_alpha(runner, features, tokens, logp, limits, params, chunk=64)
    return step_distribution(alpha, limits, [t == EOS for t in ids], BLOCK)


@pytest.mark.slow  # about 40 s of CPU (training the drafter, 48 live runs)
@pytest.mark.parametrize("params", PARAMS, ids=["T0.7", "T1-top_p0.9-top_k40"])
def test_live_acceptance_agrees_with_expected_tau(models, params):
    target, drafter, runner, prompts = models
    residual, variance, taus = 0.0, 0.0, []
    for seed in range(SEEDS):
        prompt = prompts[seed % len(prompts)]
        torch.manual_seed(seed)
        steps, ids = run_reference_loop(
            drafter,
            target,
            prompt,
            MAX_NEW,
            [EOS],
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.dflash_top_k,
        )
        dist = _offline(target, runner, ids, len(prompt), params)
        assert dist.tokens == sum(steps)
        assert dist.steps_pmf[len(steps)] > 0, f"seed {seed}: {len(steps)} steps are impossible offline"
        if steps:
            residual += float(np.mean(steps)) - dist.expected_tau
            variance += dist.tau_variance
            taus.append(dist.expected_tau)
    assert variance > 0 and max(taus) > 1.2  # acceptance is neither trivial nor certain
    z = residual / math.sqrt(variance)
    print(
        f"{params}: z {z:.3f}, mean expected tau {np.mean(taus):.3f}, mean realised {np.mean(taus) + residual / len(taus):.3f}"
    )
    assert abs(z) < 4, f"live mean tau differs from offline's expectation by {z:.2f} standard deviations"
