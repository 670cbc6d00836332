"""Offline = the demo server's sampled loop at temperature > 0 under SGLang's target-only verification, on tiny models.

The live side is the demo server's loop (demo.sampled: greedy drafts, SGLang 0.5.23's target-only verify,
seeded); the offline side is the evaluator run on that loop's own sampled output, exactly as on a greedy
completion (all_anchor.evaluate_sample, the reference of the stage's trajectory evaluator). Since a rejected
draft is never emitted, every step must be equal, bar the last: the live loop verifies its last block full and
cuts the output after it (SGLang's tail), offline sees only the output. A lossy threshold keeps that equality
(a rejected draft is still never emitted) but biases the output toward the drafter.
"""

from __future__ import annotations

import pytest
import torch

from dflash_eval.demo.sampled import sampled_generate
from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.all_anchor import evaluate_sample
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.methods import chain_method
from tests.support.tiny import (
    MASK_ID,
    greedy_sequences,
    layer_features,
    tiny_drafter,
    tiny_target,
    train_briefly,
)

EOS = 1
MAX_NEW = 24
LAYERS = [0, 2]
BLOCK = 4
SAMPLINGS = [
    {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
    {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 8, "min_p": 0.1},
]


@pytest.fixture(scope="module")
def models():
    """A tiny hybrid target and a drafter trained briefly on its greedy output (acceptance far from trivial)."""
    target = tiny_target(seed=0)
    with torch.no_grad():  # a confident target (a random one is near uniform): sampled output the drafter can follow
        target.lm_head.weight.mul_(20.0)
    prompts, sequences = greedy_sequences(target, [8 + i for i in range(4)], LAYERS, MAX_NEW, EOS)
    drafter = tiny_drafter(LAYERS, block_size=BLOCK, window=5)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    train_briefly(drafter, runner, sequences, steps=120)
    return target, drafter.eval(), runner, [p.tolist() for p in prompts]


def _offline_steps(target, runner, prompt: list[int], completion: list[int]) -> list[int]:
    tokens = torch.tensor(prompt + completion)
    limits = sequence_limits(len(prompt), len(tokens), None, completion[-1] == EOS)
    return evaluate_sample(runner, layer_features(target, tokens, LAYERS), tokens, limits, {EOS}).steps[
        chain_method(BLOCK)
    ]


def _live(target, drafter, prompt, drawn, thresholds=(1.0, 1.0)):
    with torch.no_grad():
        return sampled_generate(drafter, target, prompt, MAX_NEW, [EOS], BLOCK, drawn, thresholds)


@pytest.mark.parametrize(
    "drawn",
    [
        pytest.param(SAMPLINGS[0], marks=pytest.mark.slow),
        SAMPLINGS[1],
        pytest.param(SAMPLINGS[2], marks=pytest.mark.slow),
    ],
    ids=["t0.5", "t0.7-p0.95", "t1-k8-p0.9-minp0.1"],
)
def test_offline_on_the_sampled_output_equals_the_live_steps(models, drawn):
    target, drafter, runner, prompts = models
    accepted = 0
    for seed in range(2):
        for prompt in prompts:
            completion, live = _live(target, drafter, prompt, {**drawn, "seed": 1000 * seed + len(prompt)})
            offline = _offline_steps(target, runner, prompt, completion)
            assert offline[:-1] == live[: len(offline) - 1], (seed, prompt)
            assert len(offline) == len(live)  # the same last anchor: only its length may be cut
            assert 1 <= offline[-1] <= live[-1]
            assert sum(live[:-1]) + offline[-1] == len(completion) - 1  # offline covers the output exactly
            accepted += sum(s - 1 for s in live)
    assert accepted >= 8, "the drafter must get drafts accepted at this temperature, else the test says little"


def test_the_live_loop_is_seeded(models):
    target, drafter, _, prompts = models
    drawn = {**SAMPLINGS[1], "seed": 7}
    assert _live(target, drafter, prompts[0], drawn) == _live(target, drafter, prompts[0], drawn)
    outputs = {tuple(_live(target, drafter, prompts[0], {**drawn, "seed": s})[0]) for s in range(4)}
    assert len(outputs) > 1


@pytest.mark.slow
def test_a_lossy_threshold_keeps_the_equality_but_not_the_distribution(models):
    """threshold_single 0.05 (SGLang's lossy mode) accepts drafts the target would rarely sample; a rejected draft
    is still never emitted, so offline on the output still equals the live steps, while the output leans toward the
    served drafter's proposals (more accepted drafts than lossless): why fetch warns (fetch.sglang.sampling_warning)."""
    target, drafter, runner, prompts = models
    lossless = lossy = 0
    for prompt in prompts[:2]:
        drawn = {**SAMPLINGS[2], "seed": 3}
        completion, live = _live(target, drafter, prompt, drawn, thresholds=(0.05, 1.0))
        assert _offline_steps(target, runner, prompt, completion)[:-1] == live[:-1]
        lossy += sum(s - 1 for s in live)
        lossless += sum(s - 1 for s in _live(target, drafter, prompt, drawn)[1])
    assert lossy > lossless
