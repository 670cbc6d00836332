"""Simulated acceptance (SGLang's SGLANG_SIMULATE_ACC_LEN, match-expected, real-draft-token): the draw's law
by hand, and the reference loop `dflash.model.dflash_generate` committing exactly the drawn lengths."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_eval.demo.live_loop import _host_clock_on_cpu
from dflash_eval.demo.reference import exact_target_rollback
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.backends import use_backend
from dflash_eval.speedup.simulate import (
    expected_length,
    forced_acceptance,
    simulated_length,
)
from tests.support.tiny import tiny_attention_target, tiny_drafter, tiny_target


def test_match_expected_is_floor_or_ceiling_with_the_requested_mean() -> None:
    rng = random.Random(0)
    draws = [simulated_length(3.25, 8, rng) for _ in range(20000)]
    assert set(draws) == {3, 4}
    assert sum(draws) / len(draws) == pytest.approx(3.25, abs=0.02)


@pytest.mark.parametrize(("tau", "block", "only"), [(3.0, 8, 3), (12.0, 8, 8), (0.4, 8, 1), (8.0, 8, 8)])
def test_clamped_to_one_and_the_block(tau: float, block: int, only: int) -> None:
    rng = random.Random(1)
    assert {simulated_length(tau, block, rng) for _ in range(50)} == {only}
    assert expected_length(tau, block) == only


def test_a_length_that_sglang_turns_off_is_an_error() -> None:
    with pytest.raises(DflashEvalError, match="must be > 0"):
        simulated_length(0.0, 8, random.Random(0))


@pytest.mark.parametrize("tau", [1.0, 2.6, 4.0])
def test_the_reference_loop_commits_exactly_the_drawn_lengths(tau: float) -> None:
    """Random weights accept ~nothing; forced, dflash_generate's own acceptance_lengths are the drawn k."""
    import dflash.model as reference

    target, drafter = tiny_target(seed=0), tiny_drafter([0, 2], block_size=4)
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0))
    with use_backend("torch", "cpu"), exact_target_rollback(target), forced_acceptance(target, tau, seed=3) as drawn:
        with _host_clock_on_cpu(prompt.device):
            stats = reference.dflash_generate(drafter, target, prompt, 30, None, block_size=4, return_stats=True)
    # every step commits what was drawn; the last is cut at the token budget (dflash_generate's tail)
    assert len(drawn) == len(stats.acceptance_lengths)
    assert stats.acceptance_lengths[:-1] == drawn[:-1] and 1 <= stats.acceptance_lengths[-1] <= drawn[-1]
    assert stats.acceptance_lengths[:-1] and all(k in (int(tau), int(tau) + 1) for k in stats.acceptance_lengths[:-1])
    assert "forward" not in vars(target)  # the class's forward is back
    # each bonus is the target's own choice after the committed tokens: its argmax, or (where the argmax was the
    # rejected draft, forced out) its runner-up, on a from-scratch forward of the output
    out = stats.output_ids[0]
    with use_backend("torch", "cpu"), torch.no_grad():
        top2 = target(out[None, :-1]).logits[0].topk(2, dim=-1).indices
    start = prompt.shape[1]
    for k in stats.acceptance_lengths[:-1]:
        start += k
        assert int(out[start]) in top2[start - 1].tolist()
    assert out.shape[0] == prompt.shape[1] + 30


@pytest.mark.parametrize("kind", ["hybrid", "attention"])
def test_the_timed_loops_produce_the_same_tokens_count_and_the_forced_steps(kind: str) -> None:
    """run_loop: block 1 is the autoregressive loop (one token a step); forced tau 3 commits 3 a step, on a
    hybrid target (exact rollback) and a pure-attention one (transformers' crop is exact there)."""
    from dflash_eval.demo.live_loop import (
        is_hybrid,
        measured_speedup,
        run_loop,
    )
    from dflash_eval.speedup.live_loops.run import LoopRun

    target = tiny_target(seed=0) if kind == "hybrid" else tiny_attention_target(2)
    assert is_hybrid(target) is (kind == "hybrid")
    drafter = tiny_drafter([0, 1], block_size=4, num_target_layers=2 if kind == "attention" else 4)
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0))
    with use_backend("torch", "cpu"):
        ar = run_loop(drafter, target, prompt, 16, 1)
        spec = run_loop(drafter, target, prompt, 16, 4, simulate_tau=3.0)
    assert ar.acceptance_lengths == [1] * 15 and ar.new_tokens == spec.new_tokens == 16
    assert spec.acceptance_lengths == [3, 3, 3, 3, 3]
    assert spec.tau == 3.0 and measured_speedup(ar, spec) == pytest.approx(ar.decode_s / spec.decode_s)
    with pytest.raises(ValueError, match="produced 16 and 15 tokens"):
        measured_speedup(ar, LoopRun(1.0, 15, [1]))
