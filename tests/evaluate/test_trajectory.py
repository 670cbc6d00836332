"""The trajectory evaluator takes the same steps as the all-anchor evaluator, for every method and sample.

The all-anchor evaluator (all_anchor.py) drafts at every anchor and is tested against the live reference
loop (test_all_anchor.py); here the trajectory evaluator must reproduce its steps exactly, on tiny
drafters of both classes and both layer mixes, with every chain block size, DDTree budgets, stop
tokens and token budgets, in pools and forwards far smaller than the data (admission, chunking), and
must compute each distinct (sample, anchor, block length) once. Top-k counts are checked against a
direct count on the blocks that chain-B's trajectory visits.
"""

import numpy as np
import pytest
import torch

from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.all_anchor import evaluate_sample
from dflash_eval.evaluate.trajectory import (
    EvaluatorOptions,
    LoadedSample,
    SampleSpec,
    TrajectoryEvaluator,
)
from dflash_eval.methods import chain_method
from tests.support import trajectory_cases as cases
from tests.support.trajectory_cases import BLOCK, BUDGETS, STOPS, TOPK


def _reference(runner, sequences):
    return {
        key: evaluate_sample(runner, features, tokens, limits, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, chunk=5)
        for key, features, tokens, limits in sequences
    }


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("window", [5, None], ids=["sliding+full", "full-only"])
@pytest.mark.parametrize(
    "pool,rows,split", [(None, 128, 2), (2, 3, None)], ids=["one-pool,head-split", "tiny-pool-and-forwards,whole-head"]
)
def test_same_steps_as_the_all_anchor_evaluator(dflash2, window, pool, rows, split):
    runner = cases.runner(dflash2, window)
    sequences = cases.sequences(runner)
    reference = _reference(runner, sequences)
    evaluator = TrajectoryEvaluator(
        runner,
        STOPS,
        range(2, BLOCK + 1),
        BUDGETS,
        TOPK,
        EvaluatorOptions(blocks_per_forward=rows, pool_slots=pool, head_split=split),
    )
    results = dict(evaluator.run(cases.specs(sequences)))
    assert sorted(results) == sorted(reference)
    for key, expected in reference.items():
        assert results[key].steps == expected.steps, key
        assert list(results[key].steps) == list(expected.steps)  # the same method order
    steps = [s for result in reference.values() for s in result.steps[chain_method(BLOCK)]]
    assert len(steps) > 40 and 1.3 < sum(steps) / len(steps) < BLOCK, "drafts too weak or too strong to test"
    assert evaluator.counts.blocks < evaluator.counts.all_anchor_blocks


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_chain_b_alone_with_the_head_split(dflash2):
    """Without trees or top-k, blocks of full size read the LM head only up to their first mismatch too."""
    runner = cases.runner(dflash2)
    sequences = cases.sequences(runner)
    evaluator = TrajectoryEvaluator(runner, STOPS, options=EvaluatorOptions(head_split=2))
    results = dict(evaluator.run(cases.specs(sequences)))
    for key, features, tokens, limits in sequences:
        expected = evaluate_sample(runner, features, tokens, limits, STOPS).steps
        assert results[key].steps == expected, key
    assert evaluator.counts.head_positions_skipped > 0


def _visits(steps, limits):
    """(anchor, block length) of every step of one trajectory."""
    anchor, out = limits.prompt_len, []
    for produced in steps:
        out.append(anchor)
        anchor += produced
    return out


def test_each_distinct_block_is_computed_once():
    runner = cases.runner()
    sequences = cases.sequences(runner)
    evaluator = TrajectoryEvaluator(
        runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(pool_slots=3, blocks_per_forward=4)
    )
    results = dict(evaluator.run(cases.specs(sequences)))
    distinct = set()
    for key, _, _, limits in sequences:
        for method, steps in results[key].steps.items():
            block = int(method.split("-")[1].lstrip("B")) if method.startswith("chain") else BLOCK
            for anchor in _visits(steps, limits):
                distinct.add((key, anchor, min(block, limits.max_length - anchor)))
    assert evaluator.counts.blocks == len(distinct)
    assert evaluator.counts.forwards >= evaluator.counts.blocks / 4


def test_topk_counts_the_blocks_chain_b_visits():
    runner = cases.runner()
    sequences = cases.sequences(runner)
    evaluator = TrajectoryEvaluator(runner, STOPS, (), BUDGETS, [1, 2, 5], EvaluatorOptions(pool_slots=4))
    results = dict(evaluator.run(cases.specs(sequences)))
    for key, features, tokens, limits in sequences:
        hits, seen = np.zeros((BLOCK - 1, 3), dtype=np.int64), np.zeros(BLOCK - 1, dtype=np.int64)
        with torch.no_grad():
            context = runner.context(features)
            for anchor in _visits(results[key].steps[chain_method(BLOCK)], limits):
                size = min(BLOCK, limits.max_length - anchor)
                logits = runner.logits(runner.block_hidden(context, tokens, torch.tensor([anchor]), size))[0]
                for position in range(size - 1):
                    if anchor + 1 + position < len(tokens):
                        seen[position] += 1
                        ranked = torch.topk(logits[position], 5).indices.tolist()
                        truth = int(tokens[anchor + 1 + position])
                        hits[position] += [truth in ranked[:k] for k in (1, 2, 5)]
        assert np.array_equal(results[key].topk_seen, seen), key
        assert np.array_equal(results[key].topk_hits, hits), key


def test_bfloat16_agrees_with_the_all_anchor_evaluator_up_to_rounding():
    """bf16 rounds differently in a packed forward, so a near-tie can flip a step; nearly all agree."""
    runner = cases.runner(dtype=torch.bfloat16)
    sequences = cases.sequences(runner, dtype=torch.bfloat16)
    reference = _reference(runner, sequences)
    results = dict(TrajectoryEvaluator(runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK).run(cases.specs(sequences)))
    same = sum(results[k].steps[m] == reference[k].steps[m] for k in reference for m in reference[k].steps)
    total = sum(len(r.steps) for r in reference.values())
    assert same >= 0.8 * total, f"{same}/{total} trajectories equal"
    for key in reference:
        tau = [
            np.mean(results[key].steps[m]) - np.mean(reference[key].steps[m])
            for m in reference[key].steps
            if reference[key].steps[m]
        ]
        assert max(abs(t) for t in tau) < 1.0, (key, tau)


def test_a_trajectory_past_the_cached_tokens_names_the_sample():
    runner = cases.runner()
    key, features, tokens, _ = cases.sequences(runner, count=1)[0]
    limits = sequence_limits(4, len(tokens), 100, True)  # claims a stop-ended completion that could run on
    tokens = tokens.clone()
    tokens[-1] = 1
    spec = SampleSpec("sample-x", len(tokens), lambda: LoadedSample(features, tokens, limits))
    with pytest.raises(ValueError, match="sample-x: offline trajectory ran past the completion"):
        list(TrajectoryEvaluator(runner, set(), (), BUDGETS).run([spec]))


def test_samples_without_a_step_finish_without_entering_the_pool():
    runner = cases.runner()
    key, features, tokens, _ = cases.sequences(runner, count=1)[0]
    tokens = tokens.clone()
    tokens[5] = 1
    stopped = sequence_limits(5, len(tokens), None, False)  # the first completion token is a stop token
    specs = [SampleSpec("stopped", len(tokens), lambda: LoadedSample(features, tokens, stopped))]
    results = dict(TrajectoryEvaluator(runner, {1}, (2,), BUDGETS, TOPK).run(specs))
    assert all(steps == [] for steps in results["stopped"].steps.values())
    assert results["stopped"].topk_seen.sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_same_steps_as_the_all_anchor_evaluator_on_cuda(dflash2):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runner = cases.runner(dflash2).to("cuda")
    sequences = [(key, f.cuda(), t.cuda(), lim) for key, f, t, lim in cases.sequences(cases.runner(dflash2))]
    reference = _reference(runner, sequences)
    results = dict(
        TrajectoryEvaluator(
            runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(pool_slots=3, blocks_per_forward=5)
        ).run(cases.specs(sequences))
    )
    for key, expected in reference.items():
        assert results[key].steps == expected.steps, key
