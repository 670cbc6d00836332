"""Offline = reference loop on tiny models: the evaluator's acceptance lengths equal the live references'.

Chain: `dflash.model.dflash_generate` at temperature 0, for the drafter's block size and every
smaller one (`block_size=b`), for a drafter mixing sliding-window and full-attention layers and one
of full-attention layers only. DDTree: a literal heap-built tree verified with the live target
(tests/support/reference.py). The drafters are trained for a few steps so that acceptance is far from
trivial. The demo-scale version (served completions) lives in tests/demo/test_offline_reference_loop.py.
"""

import pytest
import torch

from dflash_eval.demo.reference import exact_target_rollback, run_reference_loop
from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.all_anchor import evaluate_sample
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.methods import chain_method, tree_method
from tests.support.reference import (
    _draft_logprobs,
    assert_same_steps,
    ddtree_reference_loop,
)
from tests.support.tiny import (
    MASK_ID,
    greedy_sequences,
    tiny_drafter,
    tiny_target,
    train_briefly,
)

EOS = 1
MAX_NEW = 40
LAYERS = [0, 2]
BLOCK = 4
BUDGETS = [2, 3, 6]
# The reference loop runs with exact cache rollback (reference.exact_target_rollback), so the live
# target computes what a from-scratch forward does up to float32 rounding; a step may differ only
# where two logits tie at that level.
TIE = 1e-5


@pytest.fixture(scope="module")
def sequences():
    torch.manual_seed(0)
    target = tiny_target(seed=0)
    _, out = greedy_sequences(target, [10 + i for i in range(6)], LAYERS, MAX_NEW, EOS)
    return target, out


def _size(block, sequence, anchor):
    """The block length the reference loop uses at `anchor` (shorter near the token budget)."""
    return min(block, sequence.prompt_len + MAX_NEW - anchor)


def _trained(target, sequences, window, dflash2=False):
    drafter = tiny_drafter(LAYERS, block_size=BLOCK, window=window, dflash2=dflash2)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    train_briefly(drafter, runner, sequences)
    return drafter, runner


@pytest.fixture(scope="module", params=[5, None], ids=["sliding+full", "full-only"])
def setup(request, sequences):
    target, seqs = sequences
    drafter, runner = _trained(target, seqs, request.param)
    offline = []
    for sequence in seqs:
        limits = sequence_limits(sequence.prompt_len, len(sequence.tokens), MAX_NEW, int(sequence.tokens[-1]) == EOS)
        offline.append(
            evaluate_sample(
                runner,
                sequence.features,
                sequence.tokens,
                limits,
                {EOS},
                block_sizes=range(2, BLOCK + 1),
                budgets=BUDGETS,
                chunk=7,
            ).steps
        )
    return target, drafter, seqs, offline


@pytest.mark.parametrize("block", range(2, BLOCK + 1))
def test_chain_equals_dflash_generate_step_by_step(setup, block):
    target, drafter, seqs, offline = setup
    all_steps = []
    for sequence, steps in zip(seqs, offline):
        prompt = sequence.tokens[: sequence.prompt_len].tolist()
        ref_steps, ref_ids = run_reference_loop(drafter, target, prompt, MAX_NEW, [EOS], block_size=block)
        mine = steps[chain_method(block)]
        ids = sequence.tokens.tolist()
        compared = assert_same_steps(
            mine,
            ref_steps,
            ref_ids,
            ids,
            sequence.prompt_len,
            target,
            TIE,
            lambda anchor: _draft_logprobs(drafter, target, ids, anchor, _size(block, sequence, anchor)),
        )
        all_steps += mine[:compared]
    assert len(all_steps) > 60, "too few steps compared for a meaningful test"
    tau = sum(all_steps) / len(all_steps)
    if block == BLOCK:
        assert tau > 1.5, f"drafter too weak for a meaningful comparison (tau {tau:.2f})"


@pytest.mark.parametrize("budget", BUDGETS)
def test_ddtree_equals_heap_tree_with_live_target(setup, budget):
    target, drafter, seqs, offline = setup
    for sequence, steps in zip(seqs, offline):
        prompt = sequence.tokens[: sequence.prompt_len].tolist()
        ref_steps, ref_ids = ddtree_reference_loop(drafter, target, prompt, MAX_NEW, [EOS], budget)
        mine = steps[tree_method(budget)]
        ids = sequence.tokens.tolist()
        assert_same_steps(
            mine,
            ref_steps,
            ref_ids,
            ids,
            sequence.prompt_len,
            target,
            TIE,
            lambda anchor: _draft_logprobs(drafter, target, ids, anchor, _size(BLOCK, sequence, anchor)),
            budget,
        )


def test_tree_tau_grows_with_budget(setup):
    """Best-first order makes the DDTree-N tree a subset of the DDTree-M tree for N < M."""
    _, _, _, offline = setup

    def tau(method):
        steps = [s for sample in offline for s in sample[method]]
        return sum(steps) / len(steps)

    taus = [tau(tree_method(n)) for n in BUDGETS]
    assert taus == sorted(taus) and taus[-1] > taus[0], taus


def _next_logits_after_partial_acceptance(target, ids, exact: bool) -> torch.Tensor:
    """Prefill 12 tokens, verify a block of 4, keep 2 (as dflash_generate does), then decode 3 more."""
    from contextlib import nullcontext

    import dflash.model as reference

    with torch.no_grad(), exact_target_rollback(target) if exact else nullcontext():
        cache = reference._make_cache(target.config)
        target(ids[:, :12], past_key_values=cache, use_cache=True)
        reference._crop_to(cache, 12)
        target(ids[:, 12:16], position_ids=torch.arange(12, 16)[None], past_key_values=cache, use_cache=True)
        reference._crop_to(cache, 14)
        return target(
            ids[:, 14:17], position_ids=torch.arange(14, 17)[None], past_key_values=cache, use_cache=True
        ).logits


def test_reference_loop_rewinds_the_hybrid_target_exactly(sequences):
    """Why run_reference_loop wraps dflash_generate: transformers' crop leaves rejected draft tokens
    in the Gated DeltaNet recurrent state; the exact rollback must match a from-scratch forward."""
    target, _ = sequences
    ids = torch.randint(2, 290, (1, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fresh = target(ids).logits[:, 14:17]
    exact = _next_logits_after_partial_acceptance(target, ids, exact=True)
    assert torch.allclose(exact, fresh, atol=1e-5), (exact - fresh).abs().max()
    published = _next_logits_after_partial_acceptance(target, ids, exact=False)
    assert (published - fresh).abs().max() > 1e-3, (
        "transformers now rewinds Gated DeltaNet states on crop; exact_target_rollback is no longer needed"
    )


def test_dflash2_chain_equals_dflash_generate_step_by_step(sequences):
    """DFlash2 (block convolutions, candidate selector): the reference loop drafts the selector's path."""
    target, seqs = sequences
    drafter, runner = _trained(target, seqs, 5, dflash2=True)
    with torch.no_grad():  # untrained codebooks would leave the selector a no-op; make it matter
        for param in drafter.candidate_selector.parameters():
            param.normal_(0, 0.5)
    all_steps = []
    for sequence in seqs:
        limits = sequence_limits(sequence.prompt_len, len(sequence.tokens), MAX_NEW, int(sequence.tokens[-1]) == EOS)
        mine = evaluate_sample(runner, sequence.features, sequence.tokens, limits, {EOS}, chunk=7).steps[
            chain_method(BLOCK)
        ]
        prompt = sequence.tokens[: sequence.prompt_len].tolist()
        ref_steps, ref_ids = run_reference_loop(drafter, target, prompt, MAX_NEW, [EOS])
        ids = sequence.tokens.tolist()
        compared = assert_same_steps(
            mine,
            ref_steps,
            ref_ids,
            ids,
            sequence.prompt_len,
            target,
            TIE,
            lambda anchor: _draft_logprobs(drafter, target, ids, anchor, _size(BLOCK, sequence, anchor)),
        )
        all_steps += mine[:compared]
    assert len(all_steps) > 30, "too few steps compared for a meaningful test"
    assert sum(all_steps) / len(all_steps) > 1.2, "drafter too weak for a meaningful comparison"
