"""The static-cache loop for a Gated DeltaNet hybrid (speedup/forwards/hybrid_target.py), in fp32 on a CPU with the torch
delta rule (conftest binds it for the references): its target's logits and features after a prefill and verify
blocks with any number of tokens kept equal the Hugging Face forward over the kept tokens; its loop gives dflash's
reference loop's tokens and steps (with the reference's exact rollback) and the target's greedy output; on a GPU,
graph replay equals the eager loop and the fla kernels give the HF forward's logits within bf16 noise."""

from __future__ import annotations

import pytest
import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.backends import BackendUnavailable, gdn_kernels, use_backend
from dflash_eval.speedup.forwards.hybrid_target import StaticHybridTarget, _GdnLayer, hybrid_unsupported
from dflash_eval.speedup.live_loops.hybrid import StaticHybridLoop
from tests.support.reference import assert_autoregressive_is_greedy, dflash_reference
from tests.support.tiny import tiny_drafter, tiny_target

LAYERS = [0, 3]  # a GDN layer's output, and the last layer's (the final-norm output, as dflash takes it)
TORCH = gdn_kernels("torch", torch.device("cpu"))  # the CPU's kernels, named (extract/backends.py)


@pytest.fixture(scope="module")
def models():
    return tiny_target(seed=0), tiny_drafter(LAYERS, block_size=4)


def _hf(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF forward's logits and drafter features over the whole sequence ids [1, L] (no cache)."""
    with torch.inference_mode():
        out = target(ids, output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_verify_blocks_with_any_kept_count_equal_the_hf_forward_over_the_kept_tokens(models) -> None:
    """Prefill, then blocks of 4 of which k are kept (k = 0..4, a device tensor), and a committed single token:
    every row of every block equals the HF forward of everything kept so far plus the block."""
    target, _ = models
    ids = torch.randint(2, 290, (1, 64), generator=torch.Generator().manual_seed(2))
    static = StaticHybridTarget(target, 128, TORCH, LAYERS)
    static.prepare(4)
    kept, cursor = ids[:, :11], 11
    with torch.inference_mode():
        logits, features = static.forward(kept, torch.zeros(1, dtype=torch.long))
        _close(logits, _hf(target, kept)[0])
        _close(features, _hf(target, kept)[1])
        for k in [2, 4, 1, 0, 3, 1, None, 2]:
            n = 1 if k is None else 4
            block = ids[:, cursor : cursor + n]
            logits, features = static.forward(block, torch.tensor([kept.shape[1]]), commit=k is None)
            expected_logits, expected_features = _hf(target, torch.cat([kept, block], dim=1))
            _close(logits, expected_logits[-n:])
            _close(features, expected_features[-n:])
            if k is not None:
                static.keep(torch.tensor([k]), 4)
            kept = torch.cat([kept, block[:, : n if k is None else k]], dim=1)
            cursor += n


def test_a_verify_leaves_the_states_and_keep_all_equals_a_commit(models) -> None:
    target, _ = models
    ids = torch.randint(2, 290, (1, 14), generator=torch.Generator().manual_seed(3))
    recorded, committed = StaticHybridTarget(target, 64, TORCH), StaticHybridTarget(target, 64, TORCH)
    recorded.prepare(4)
    zero = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        for static in (recorded, committed):
            static.forward(ids[:, :10], zero, features=False)
        before = [(layer.conv.clone(), layer.recurrent.clone()) for layer in recorded.gdn.values()]
        recorded.forward(ids[:, 10:], torch.tensor([10]), features=False, commit=False)
        for (conv, state), layer in zip(before, recorded.gdn.values(), strict=True):
            assert torch.equal(conv, layer.conv) and torch.equal(state, layer.recurrent)
        recorded.keep(torch.tensor([4]), 4)
        committed.forward(ids[:, 10:], torch.tensor([10]), features=False)
    for mine, theirs in zip(recorded.gdn.values(), committed.gdn.values(), strict=True):
        assert mine.recurrent.dtype == torch.float32
        torch.testing.assert_close(mine.conv, theirs.conv, rtol=0, atol=0)
        torch.testing.assert_close(mine.recurrent, theirs.recurrent, rtol=1e-5, atol=1e-6)


def _reference(drafter, target, prompt, new_tokens: int, block: int, tau: float | None, seed: int):
    """dflash's loop with an exact hybrid rollback (demo/reference.py: transformers' crop keeps rejected tokens
    in the GDN states), the torch delta rule bound (conftest)."""
    return dflash_reference(drafter, target, prompt, new_tokens, block, tau, seed, exact_rollback=True)


@pytest.mark.parametrize(("prompt_len", "tau"), [(9, None), (9, 2.6), (9, 4.0), (3, 3.3)])
def test_equals_dflash_generate_step_for_step(models, prompt_len: int, tau: float | None) -> None:
    """Greedy and simulated (each bonus is the target's choice after the k kept tokens, so a state that kept a
    rejected draft would change the output); a prompt shorter than the block pads the first context."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    loop = StaticHybridLoop(target, drafter, 64, [4], graphs=False, kernels=TORCH)
    run = loop.generate(prompt, 30, 4, tau, seed=3)
    expected = _reference(drafter, target, prompt, 30, 4, tau, seed=3)
    assert run.acceptance_lengths == expected.acceptance_lengths
    assert torch.equal(run.output_ids, expected.output_ids)
    assert run.new_tokens == 30 and run.output_ids.shape[1] == prompt_len + 30
    if tau is not None:  # simulated acceptance forces the asked lengths
        assert all(k in (int(tau), int(tau) + 1) for k in run.acceptance_lengths[:-1])


def test_one_loop_at_two_block_sizes_keeps_a_record_per_size(models) -> None:
    """Blocks 2 and 4 in one loop (each its own verify record), alternating: each equals the reference."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(9))
    loop = StaticHybridLoop(target, drafter, 64, [2, 4], graphs=False, kernels=TORCH)
    for block, tau in [(2, 1.5), (4, 2.6), (2, None)]:
        run = loop.generate(prompt, 25, block, tau, seed=4)
        expected = _reference(drafter, target, prompt, 25, block, tau, seed=4)
        assert run.acceptance_lengths == expected.acceptance_lengths
        assert torch.equal(run.output_ids, expected.output_ids)


def test_without_the_rollback_the_output_differs(models, monkeypatch) -> None:
    """The comparison above can fail: a loop that keeps all b tokens in the GDN states drifts from the reference."""
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(9))
    original = _GdnLayer.keep
    monkeypatch.setattr(_GdnLayer, "keep", lambda self, kept, n: original(self, torch.full_like(kept, n), n))
    run = StaticHybridLoop(target, drafter, 64, [4], graphs=False, kernels=TORCH).generate(prompt, 30, 4, 2.6, seed=3)
    monkeypatch.undo()
    assert not torch.equal(run.output_ids, _reference(drafter, target, prompt, 30, 4, 2.6, seed=3).output_ids)


def test_the_autoregressive_loop_is_the_targets_greedy_output(models) -> None:
    target, drafter = models
    prompt = torch.randint(2, 290, (1, 7), generator=torch.Generator().manual_seed(1))
    loop = StaticHybridLoop(target, drafter, 64, [4], graphs=False, kernels=TORCH)
    loop.generate(prompt, 12, 4, 2.0)  # a previous sequence's states must not leak into the next
    assert_autoregressive_is_greedy(loop, target, prompt, 20)


def test_step_terms_add_the_rollback(models) -> None:
    target, drafter = models
    loop = StaticHybridLoop(target, drafter, 64, [4], graphs=False, kernels=TORCH)
    terms = loop.step_terms(4, repeats=2, budget_s=0.05)
    assert set(terms) == {"verify", "draft", "accept_host", "rollback"} and all(t["ms"] > 0 for t in terms.values())
    assert set(loop.step_terms(1, repeats=2, budget_s=0.05)) == {"verify", "accept_host"}


def test_kernels_are_chosen_by_name_not_by_import() -> None:
    assert gdn_kernels(None, torch.device("cpu")).name == "torch"
    kernels = gdn_kernels("torch", torch.device("cpu"))
    assert kernels.chunk.__name__ == "torch_chunk_gated_delta_rule"
    assert kernels.recurrent.__name__ == "torch_recurrent_gated_delta_rule"
    with pytest.raises(BackendUnavailable, match="cannot run on device 'cpu'"):
        gdn_kernels("fla", torch.device("cpu"))
    with pytest.raises(DflashEvalError, match="unknown"):
        gdn_kernels("triton", torch.device("cpu"))


def test_what_the_hybrid_target_refuses(models) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    attention = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    nxt = Qwen3NextForCausalLM(
        Qwen3NextConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
        )
    )
    assert hybrid_unsupported(models[0]) is None
    assert "StaticLoop" in hybrid_unsupported(attention)
    assert "Qwen3NextGatedDeltaNet" in hybrid_unsupported(nxt)  # its fused in_proj_qkvz is not written here
    with pytest.raises(DflashEvalError, match="pure-attention"):
        StaticHybridTarget(attention, 64, TORCH)
    static = StaticHybridTarget(models[0], 64, TORCH)
    with pytest.raises(DflashEvalError, match=r"prepare\(3\)"):
        static.forward(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, dtype=torch.long), commit=False)
    tree = (torch.zeros(2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(DflashEvalError, match="tree"):
        static.forward(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long), tree=tree)


def _gpu_target(dtype: torch.dtype):
    """A hybrid with fla-friendly head sizes (64), 3 GDN : 1 attention layers, on CUDA."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    return Qwen3_5ForCausalLM(config).eval().to("cuda", dtype)


@pytest.mark.gpu
def test_graph_replay_equals_the_eager_loop_on_cuda() -> None:
    """fla kernels in both; the captured steps (the rollback inside the accept graph) give the eager loop's
    tokens and steps, at block 1, greedy and simulated."""
    target = _gpu_target(torch.bfloat16)
    drafter = tiny_drafter(LAYERS, block_size=4, hidden=256).to("cuda", torch.bfloat16)
    prompt = torch.randint(2, 290, (1, 9), generator=torch.Generator().manual_seed(0)).cuda()
    fla = gdn_kernels("fla", torch.device("cuda"))
    eager = StaticHybridLoop(target, drafter, 64, [4], graphs=False, kernels=fla)
    graphs = StaticHybridLoop(target, drafter, 64, [4], graphs=True, kernels=fla)
    assert graphs.graphs and graphs.target.kernels.name == "fla"
    for block, tau in [(1, None), (4, None), (4, 2.6), (4, 3.7)]:
        a = eager.generate(prompt, 30, block, tau, seed=5)
        b = graphs.generate(prompt, 30, block, tau, seed=5)
        assert a.acceptance_lengths == b.acceptance_lengths and torch.equal(a.output_ids, b.output_ids)
        if tau is not None:
            assert all(k in (int(tau), int(tau) + 1) for k in b.acceptance_lengths[:-1])
    assert set(graphs.step_terms(4, repeats=2, budget_s=0.05)) == {"verify", "draft", "accept_host", "rollback"}


@pytest.mark.gpu
def test_fla_kernels_give_the_hf_forward_with_fla_bound() -> None:
    """bf16: a prefill, then blocks of 4 with k kept, against the HF forward over the kept tokens (fla bound):
    within bf16 noise (relative error of the logits under 3%)."""
    target = _gpu_target(torch.bfloat16)
    ids = torch.randint(2, 290, (1, 48), generator=torch.Generator().manual_seed(2)).cuda()
    static = StaticHybridTarget(target, 128, gdn_kernels("fla", torch.device("cuda")), LAYERS)
    static.prepare(4)

    def near(actual: torch.Tensor, expected: torch.Tensor) -> None:
        error = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert error < 3e-2, f"relative error {error:.4f}"

    kept, cursor = ids[:, :20], 20
    with use_backend("fla", "cuda"), torch.inference_mode():
        logits, _ = static.forward(kept, torch.zeros(1, dtype=torch.long, device="cuda"))
        near(logits, target(kept).logits[0])
        for k in [2, 4, 1, 3]:
            block = ids[:, cursor : cursor + 4]
            logits, _ = static.forward(block, torch.tensor([kept.shape[1]], device="cuda"), commit=False)
            near(logits, target(torch.cat([kept, block], dim=1)).logits[0, -4:])
            static.keep(torch.tensor([k], device="cuda"), 4)
            kept, cursor = torch.cat([kept, block[:, :k]], dim=1), cursor + 4
        logits, _ = static.forward(ids[:, cursor : cursor + 1], torch.tensor([kept.shape[1]], device="cuda"))
        near(logits, target(torch.cat([kept, ids[:, cursor : cursor + 1]], dim=1)).logits[0, -1:])
