"""The DDTree live loop (speedup/live_loops/tree.py) in fp32 on a CPU: tree verify never changes the output (the
target's greedy tokens), and each step accepts what the offline DDTree evaluator (evaluate/ddtree.py) scores for
the same drafter logits and the same greedy continuation; the tree itself on hand-made log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_eval.evaluate.ddtree import tree_accepted
from dflash_eval.speedup.forwards.tree_step import ancestors, build_tree
from dflash_eval.speedup.live_loops.tree import PHASES, TreeLoop
from tests.support.tiny import tiny_attention_target, tiny_drafter


@pytest.fixture(scope="module")
def models():
    return tiny_attention_target(), tiny_drafter([0, 2], block_size=4, num_target_layers=3)


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
    assert mask[2].tolist() == [True, True, True, False, False] and mask[4].tolist() == [True, False, False, True, True]


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
        truth = tokens[start + 1 : start + 4]
        truth = torch.cat([truth, torch.full((3 - truth.shape[0],), -1)])
        offline = int(tree_accepted(logits[None].float(), truth[None], [budget])[0, 0])
        assert produced == offline + 1
        start += produced
    assert len(loop.trace) == len(run.acceptance_lengths)


def favoured_loop(models, seed: int, budget: int) -> tuple[torch.Tensor, torch.Tensor, TreeLoop]:
    """A prompt, the target's greedy 24 tokens after it, and a tree loop (block 4) whose drafter favours them at
    every drafted position, except that position 2's rank 0 is wrong (its rank 1 right): the tree must branch."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    loop = TreeLoop(target, drafter, 64, 4, [budget], graphs=False)
    original = loop.drafter.draft_logits

    def favoured(features, ctx_start, bonus, start, block):
        logits, s = original(features, ctx_start, bonus, start, block).clone(), int(start)
        for d in range(block - 1):
            if s + 1 + d < greedy.shape[1]:
                logits[d, greedy[0, s + 1 + d]] += 49.0 if d == 1 else 50.0
                logits[d, (int(greedy[0, s + 1 + d]) + 1) % 300] += 50.0 if d == 1 else 0.0
        return logits

    loop.drafter.draft_logits = favoured
    return prompt, greedy, loop


def test_a_trained_like_drafter_accepts_along_the_tree(models) -> None:
    """A drafter whose logits favour the target's own continuation: the tree accepts more than one token a step
    (the walk and the compaction are exercised, and the output is still the target's)."""
    prompt, greedy, loop = favoured_loop(models, seed=0, budget=6)
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


def _reference_tree_run(
    loop: TreeLoop, prompt: torch.Tensor, new_tokens: int, budget: int, tau: float | None, seed: int
) -> tuple[list[int], list[int]]:
    """The loop as first written (host-side top-k, walk, bonus and compaction, eager): its output ids and
    acceptance lengths, the expectation the server-like loop (device-side bookkeeping) must meet exactly."""
    import random

    from dflash_eval.speedup.simulate import simulated_length

    b = loop.block
    with torch.inference_mode():
        n = loop.prefill(prompt, b)
        out, lengths, start, rng = loop.out[: n + 1].tolist(), [], n, random.Random(seed)
        while start + 1 < n + new_tokens:
            forced = simulated_length(tau, b, rng) if tau is not None else None
            logits = loop.drafter.draft_logits(loop.features[b], loop.ctx_start, loop.ids[b][0, :1], loop.start, b)
            top = torch.log_softmax(logits.float(), -1).topk(min(budget, logits.shape[1]), -1)
            parents, depths, tokens = build_tree(
                top.values.cpu().numpy(), top.indices.cpu().numpy(), budget, tau is not None
            )
            size, mask = len(parents), np.eye(budget + 1, dtype=bool)
            mask[:size, :size] = ancestors(parents)
            ids, depth = torch.zeros(1, budget + 1, dtype=torch.long), torch.zeros(budget + 1, dtype=torch.long)
            ids[0, :size], depth[:size] = torch.tensor([out[-1], *tokens[1:]]), torch.tensor(depths)
            ids, depth, on = ids.to(loop.device), depth.to(loop.device), torch.from_numpy(mask).to(loop.device)
            logits, features = loop.target.forward(ids, loop.start, tree=(depth, on))
            children: dict[int, list[int]] = {}
            for node, parent in enumerate(parents[1:], start=1):
                children.setdefault(parent, []).append(node)
            path = [0]
            while (
                forced is None and any(tokens[c] == int(logits[path[-1]].argmax()) for c in children.get(path[-1], []))
            ) or (forced is not None and len(path) < forced and children.get(path[-1])):
                path.append(
                    next(
                        c
                        for c in children[path[-1]]
                        if forced is not None or tokens[c] == int(logits[path[-1]].argmax())
                    )
                )
            row = logits[path[-1]].float().clone()
            if forced is not None and children.get(path[-1]):
                row[tokens[children[path[-1]][0]]] = float("-inf")
            out.extend([tokens[i] for i in path[1:]] + [int(row.argmax())])
            loop.target.compact(start, torch.tensor(path, device=loop.device) + start)
            loop.features[b].zero_()
            loop.features[b][: len(path)] = features[torch.tensor(path, device=loop.device)]
            loop.ctx_start.fill_(start)
            lengths.append(min(len(path), n + new_tokens - start - 1))
            start += len(path)
            loop.start.fill_(start)
            loop.ids[b][0, 0] = out[-1]
    return out[: n + new_tokens], lengths


@pytest.mark.parametrize(
    ("budget", "tau", "seed"), [(3, None, 0), (8, None, 1), (6, 2.5, 2), (8, 3.7, 3), (16, 1.6, 4), (2, 4.0, 5)]
)
def test_the_loop_equals_its_first_host_side_version(models, budget: int, tau: float | None, seed: int) -> None:
    """Device-side top-k, walk upload and accept graph change nothing: the same tokens and the same steps as the
    host-side loop it replaced (greedy and simulated; budgets above and below the block's positions)."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(10 + seed))
    loop = TreeLoop(target, drafter, 64, 4, sorted({budget, 16}), graphs=False)
    expected_ids, expected_lengths = _reference_tree_run(loop, prompt, 30, budget, tau, seed)
    run = loop.generate_tree(prompt, 30, budget, tau, seed)
    assert run.acceptance_lengths == expected_lengths
    assert run.output_ids[0].tolist() == expected_ids


def test_a_greedy_walk_past_the_root_equals_the_first_version(models) -> None:
    """A drafter that favours the target's continuation (the greedy walk accepts, the path's keys move): the
    same tokens and steps as the host-side loop."""
    prompt, greedy, loop = favoured_loop(models, seed=7, budget=5)
    expected_ids, expected_lengths = _reference_tree_run(loop, prompt, 24, 5, None, 0)
    run = loop.generate_tree(prompt, 24, 5)
    assert run.acceptance_lengths == expected_lengths and max(expected_lengths) > 1
    assert run.output_ids[0].tolist() == expected_ids == greedy[0].tolist()


def test_the_breakdown_clocks_each_phase_and_changes_nothing(models) -> None:
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(3))
    loop = TreeLoop(target, drafter, 64, 4, [6], graphs=False)
    plain = loop.generate_tree(prompt, 20, 6, 2.5, seed=1)
    timed = loop.generate_tree(prompt, 20, 6, 2.5, seed=1, breakdown=True)
    assert plain.phases_s is None and set(timed.phases_s) == set(PHASES)
    assert all(s > 0 for s in timed.phases_s.values()) and sum(timed.phases_s.values()) <= timed.decode_s
    assert timed.acceptance_lengths == plain.acceptance_lengths and torch.equal(timed.output_ids, plain.output_ids)


@pytest.mark.gpu
def test_graph_replay_of_the_tree_loop_equals_the_eager_loop_on_cuda() -> None:
    """The captured draft (with its top-k), verify and accept graphs give the eager loop's tokens and steps
    (fp32), greedy and simulated, at two budgets (one wider than the vocab's top-k would need: 3 positions)."""
    target, drafter = tiny_attention_target(), tiny_drafter([0, 2], block_size=4, num_target_layers=3)
    target, drafter = target.cuda(), drafter.cuda()
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    eager = TreeLoop(target, drafter, 64, 4, [4, 16], graphs=False)
    graphs = TreeLoop(target, drafter, 64, 4, [4, 16], graphs=True)
    assert graphs.graphs
    for budget, tau in [(4, None), (16, None), (4, 2.6), (16, 3.7)]:
        a = eager.generate_tree(prompt, 30, budget, tau, seed=5)
        b = graphs.generate_tree(prompt, 30, budget, tau, seed=5)
        assert a.acceptance_lengths == b.acceptance_lengths and torch.equal(a.output_ids, b.output_ids)
    timed = graphs.generate_tree(prompt, 30, 16, 3.7, seed=5, breakdown=True)
    assert timed.acceptance_lengths == b.acceptance_lengths and set(timed.phases_s) == set(PHASES)
    expected_ids, expected_lengths = _reference_tree_run(eager, prompt, 30, 16, 3.7, 5)
    assert b.acceptance_lengths == expected_lengths and b.output_ids[0].tolist() == expected_ids
