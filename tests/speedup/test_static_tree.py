"""The DDTree live loop (speedup/static_tree.py) in fp32 on a CPU: tree verify never changes the output (the
target's greedy tokens), and each step accepts what the offline DDTree evaluator (evaluate/ddtree.py) scores for
the same drafter logits and the same greedy continuation; the tree itself on hand-made log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_eval.evaluate.ddtree import tree_accepted
from dflash_eval.speedup.static_tree import TreeLoop, ancestors, build_tree
from tests.speedup.test_static_loop import _attention_target
from tests.support.tiny import tiny_drafter


@pytest.fixture(scope="module")
def models():
    return _attention_target(), tiny_drafter([0, 2], block_size=4, num_target_layers=3)


def test_the_tree_is_built_best_first() -> None:
    """P = 2 positions, top-2 each: log-probs [[-0.1, -1.0], [-0.2, -3.0]] (the second row's ranks hold for
    every parent here). Scores: a = -0.1, a's child c = -0.3, b = -1.0, b's child = -1.2, a's 2nd child -3.1."""
    log_probs = np.array([[-0.1, -1.0], [-0.2, -3.0]], dtype=np.float32)
    tokens = np.array([[10, 11], [20, 21]])
    parents, depths, node_tokens = build_tree(log_probs, tokens, 4)
    assert parents == [-1, 0, 1, 0, 3] and depths == [0, 1, 2, 1, 2] and node_tokens == [-1, 10, 20, 11, 20]
    assert build_tree(log_probs, tokens, 2)[0] == [-1, 0, 1]
    assert build_tree(log_probs, tokens, 3, spine=True)[0] == [-1, 0, 1, 0]  # the chain first, then b
    flat = np.full((3, 4), -1.0, dtype=np.float32)  # a random drafter's flat rows: one level deep, unless spine
    assert build_tree(flat, np.arange(12).reshape(3, 4), 4)[1] == [0, 1, 1, 1, 1]
    assert build_tree(flat, np.arange(12).reshape(3, 4), 4, spine=True)[1] == [0, 1, 2, 3, 1]
    mask = ancestors(parents)
    assert mask[2].tolist() == [True, True, True, False, False] and mask[4].tolist() == [True, False, False,
                                                                                          True, True]


@pytest.mark.parametrize("budget", [3, 8])
def test_greedy_tree_loop_is_the_targets_output_and_the_offline_evaluators_steps(models, budget: int) -> None:
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(budget))
    loop = TreeLoop(target, drafter, 64, 4, [budget], graphs=False)
    loop.trace = []
    run = loop.generate_tree(prompt, 30, budget)
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=30, do_sample=False, min_new_tokens=30)
    assert torch.equal(run.output_ids, greedy) and run.new_tokens == 30
    tokens, start = greedy[0], prompt.shape[1]
    for logits, produced in zip(loop.trace, run.acceptance_lengths[:-1]):
        truth = tokens[start + 1:start + 4]
        truth = torch.cat([truth, torch.full((3 - truth.shape[0],), -1)])
        offline = int(tree_accepted(logits[None].float(), truth[None], [budget])[0, 0])
        assert produced == offline + 1
        start += produced
    assert len(loop.trace) == len(run.acceptance_lengths)


def test_a_trained_like_drafter_accepts_along_the_tree(models) -> None:
    """A drafter whose logits favour the target's own continuation: the tree accepts more than one token a step
    (the walk and the compaction are exercised, and the output is still the target's)."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    loop = TreeLoop(target, drafter, 64, 4, [6], graphs=False)
    original = loop.drafter.draft_logits
    state = {"start": prompt.shape[1]}

    def cheat(features, ctx_start, bonus, start, block):
        logits = original(features, ctx_start, bonus, start, block).clone()
        s = int(start)
        for d in range(block - 1):
            if s + 1 + d < greedy.shape[1] and d != 1:  # position 2 is wrong at rank 0: the tree must branch
                logits[d, greedy[0, s + 1 + d]] += 50.0
            elif s + 1 + d < greedy.shape[1]:
                logits[d, greedy[0, s + 1 + d]] += 49.0
                logits[d, (int(greedy[0, s + 1 + d]) + 1) % 300] += 50.0
        state["start"] = s
        return logits
    loop.drafter.draft_logits = cheat
    run = loop.generate_tree(prompt, 24, 6)
    assert torch.equal(run.output_ids, greedy)
    assert max(run.acceptance_lengths) == 4 and run.tau > 2


def test_simulated_acceptance_forces_k_along_the_best_path(models) -> None:
    """k - 1 drafts along the best path (capped at its depth), then the bonus: k = 1 commits one token a step."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(2))
    loop = TreeLoop(target, drafter, 64, 4, [8], graphs=False)
    assert loop.generate_tree(prompt, 30, 8, simulate_tau=1.0).acceptance_lengths == [1] * 29
    run = loop.generate_tree(prompt, 30, 8, simulate_tau=2.5, seed=4)
    assert set(run.acceptance_lengths[:-1]) <= {2, 3} and 3 in run.acceptance_lengths
    assert set(loop.generate_tree(prompt, 30, 8, simulate_tau=4.0).acceptance_lengths[:-1]) == {4}
