"""Offline = online on tiny models: the evaluator's acceptance lengths equal the reference loop's.

The demo-scale version of this test (served completions, trained demo drafter) lives in
test_demo_offline_online.py; this one runs in seconds on random tiny models with a drafter trained
for a few steps, so that acceptance is far from trivial.
"""

import random

import pytest
import torch

from dflash_eval.acceptance import sequence_limits
from dflash_eval.blocks import BlockDrafter
from dflash_eval.demo.drafters import TrainingSequence, block_loss
from dflash_eval.evaluator import evaluate_sample

from reference import first_difference, online_acceptance
from tiny import MASK_ID, tiny_drafter, tiny_target

EOS = 1
MAX_NEW = 40
LAYERS = [0, 2]


def _features(target, tokens):
    with torch.no_grad():
        hidden = target(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in LAYERS], dim=-1)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target(seed=0)
    prompts = [torch.randint(2, 290, (10 + i,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            out = target.generate(prompt[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS,
                                  pad_token_id=EOS)[0]
            sequences.append(TrainingSequence(out, _features(target, out), len(prompt)))
    drafter = tiny_drafter(LAYERS, block_size=4, window=5)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    rng = random.Random(0)
    drafter.train()
    for _ in range(150):
        loss = block_loss(runner, sequences[rng.randrange(len(sequences))], 16, rng, decay=4.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    return target, drafter, runner, sequences


def test_offline_equals_online_step_by_step(setup):
    target, drafter, runner, sequences = setup
    all_steps = []
    for sequence in sequences:
        prompt = sequence.tokens[: sequence.prompt_len].tolist()
        online, online_ids = online_acceptance(drafter, target, prompt, MAX_NEW, [EOS])
        assert online_ids == sequence.tokens.tolist(), "the reference loop must reproduce the greedy completion"
        limits = sequence_limits(sequence.prompt_len, len(sequence.tokens), MAX_NEW, int(sequence.tokens[-1]) == EOS)
        offline = evaluate_sample(runner, sequence.features, sequence.tokens, limits, {EOS}, chunk=7).steps
        assert first_difference(offline, online) is None, (offline, online)
        all_steps += offline
    tau = sum(all_steps) / len(all_steps)
    assert tau > 1.5, f"drafter too weak for a meaningful comparison (tau {tau:.2f})"
