"""The static-cache loop (speedup/live_loops/chain.py) against dflash's own loop `dflash_generate`: the same output
tokens and the same per-step acceptance in fp32 on a CPU (run eagerly: no graphs there), greedy and with simulated
acceptance; the device-side acceptance on hand-made logits; on a GPU, graph replay equals the eager loop."""

from __future__ import annotations

import pytest
import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.speedup.live_loops.chain import StaticLoop
from tests.support.reference import assert_autoregressive_is_greedy, dflash_reference
from tests.support.tiny import tiny_attention_target, tiny_drafter, tiny_target


def _reference(drafter, target, prompt, new_tokens: int, block: int, tau: float | None, seed: int):
    return dflash_reference(drafter, target, prompt, new_tokens, block, tau, seed)


@pytest.fixture(scope="module")
def models():
    # layer 2 is the target's last: its feature is the final-norm output, as dflash's extract_context_feature takes
    return tiny_attention_target(), tiny_drafter([0, 2], block_size=4, num_target_layers=3)


@pytest.mark.parametrize(("prompt_len", "tau"), [(9, None), (9, 2.6), (9, 4.0), (3, 3.3)])
def test_equals_dflash_generate_step_for_step(models, prompt_len: int, tau: float | None) -> None:
    """Greedy (a random drafter accepts ~nothing) and simulated (the bonus is the target's argmax with draft k
    excluded, so the drafted tokens shape the output); a prompt shorter than the block pads the first context."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    loop = StaticLoop(target, drafter, 64, [4], graphs=False)
    run = loop.generate(prompt, 30, 4, tau, seed=3)
    expected = _reference(drafter, target, prompt, 30, 4, tau, seed=3)
    assert run.acceptance_lengths == expected.acceptance_lengths
    assert torch.equal(run.output_ids, expected.output_ids)
    assert run.new_tokens == 30 and run.output_ids.shape[1] == prompt_len + 30
    if tau is not None:
        assert all(k in (int(tau), int(tau) + 1) for k in run.acceptance_lengths[:-1])


def test_the_autoregressive_loop_is_the_targets_greedy_output(models) -> None:
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 7), generator=torch.Generator().manual_seed(1))
    loop = StaticLoop(target, drafter, 64, [4], graphs=False)
    assert_autoregressive_is_greedy(loop, target, prompt, 20)


def test_device_side_acceptance_on_hand_made_logits(models) -> None:
    """Block [b0, d1, d2, d3] at s = 10; the target's argmax after b0, d1, d2 is d1, d2, x: 2 drafts accepted,
    the bonus is x; simulated k = 1 keeps none and takes row 0's best token other than d1."""
    target, drafter = models
    loop = StaticLoop(target, drafter, 64, [4], graphs=False)
    with torch.inference_mode():
        loop.ids[4][0] = torch.tensor([5, 11, 12, 13])
        logits = torch.zeros(4, 300)
        logits[0, 11], logits[0, 40] = 3.0, 2.0  # row 0: d1, then 40
        logits[1, 12] = 3.0  # row 1: d2
        logits[2, 77] = 3.0  # row 2: 77, not d3: the bonus
        loop.logits[4].copy_(logits)
        loop.start.fill_(10)
        loop.steps[("accept", 4)]()
        assert int(loop.acc) == 2 and int(loop.start) == 13 and int(loop.ctx_start) == 10
        assert loop.out[10:14].tolist() == [5, 11, 12, 77] and int(loop.ids[4][0, 0]) == 77
        loop.ids[4][0] = torch.tensor([5, 11, 12, 13])
        loop.start.fill_(10)
        loop.sim.fill_(1)
        loop.steps[("accept", 4)]()
        assert int(loop.acc) == 0 and int(loop.start) == 11 and loop.out[10:12].tolist() == [5, 40]


def test_step_terms_are_timed_per_block(models) -> None:
    target, drafter = models
    loop = StaticLoop(target, drafter, 64, [4], graphs=False)
    terms = loop.step_terms(4, repeats=2, budget_s=0.05)
    assert set(terms) == {"verify", "draft", "accept_host"} and all(t["ms"] > 0 for t in terms.values())
    assert set(loop.step_terms(1, repeats=2, budget_s=0.05)) == {"verify", "accept_host"}


def test_a_gated_deltanet_target_is_refused_with_the_way_out() -> None:
    with pytest.raises(DflashEvalError, match="Gated DeltaNet.*--loop eager"):
        StaticLoop(tiny_target(seed=0), tiny_drafter([0, 1], block_size=4), 64, [4], graphs=False)


@pytest.mark.gpu
def test_graph_replay_equals_the_eager_loop_on_cuda() -> None:
    """The captured steps give the eager loop's tokens and steps (fp32; bf16 rounds alike in both)."""
    target, drafter = tiny_attention_target(), tiny_drafter([0, 2], block_size=4, num_target_layers=3)
    target, drafter = target.cuda(), drafter.cuda()
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    eager = StaticLoop(target, drafter, 64, [4], graphs=False)
    graphs = StaticLoop(target, drafter, 64, [4], graphs=True)
    assert graphs.graphs
    for block, tau in [(1, None), (4, None), (4, 2.6), (4, 3.7)]:
        a = eager.generate(prompt, 30, block, tau, seed=5)
        b = graphs.generate(prompt, 30, block, tau, seed=5)
        assert a.acceptance_lengths == b.acceptance_lengths and torch.equal(a.output_ids, b.output_ids)
    expected = _reference(drafter, target, prompt, 30, 4, 2.6, seed=5)
    assert expected.acceptance_lengths == graphs.generate(prompt, 30, 4, 2.6, seed=5).acceptance_lengths


def test_a_span_limited_step_equals_the_hf_forward() -> None:
    """What the profile times (tools/target_timing.py, `graphs`/`static`): n tokens after a prefilled context over the
    first ceil64(context + n) cache positions give the HF forward's logits for those tokens (fp32)."""
    from dflash_eval.speedup.forwards.target import StaticTarget

    target = tiny_attention_target()
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(4))
    static = StaticTarget(target, 192)
    with torch.inference_mode():
        static.forward(ids[:, :70], torch.zeros(1, dtype=torch.long), features=False)
        logits, _ = static.forward(ids[:, 70:], torch.tensor([70]), features=False, span=128)
        expected = target(ids).logits[0, 70:]
        wrong, _ = static.forward(ids[:, 70:], torch.tensor([70]), features=False, span=64)  # cuts the context
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(wrong, expected, rtol=1e-4, atol=1e-4)


def test_which_targets_the_static_cache_runs() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_eval.speedup.forwards.target import static_unsupported

    assert static_unsupported(tiny_attention_target()) is None
    assert "Gated DeltaNet" in static_unsupported(tiny_target(seed=0))
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    assert "'llama'" in static_unsupported(llama)
