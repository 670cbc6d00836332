"""Kernel backend selection: forced, verified by call counts, restored, loud when impossible."""

import re

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_eval.extract.backends import (
    ROLE_NAMES,
    BackendMismatch,
    BackendUnavailable,
    ambient_binding,
    select_backend,
    torch_function,
    use_backend,
)
from tests.support.tiny import tiny_target

TORCH_CHUNK = "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"
TORCH_CONV = "transformers.models.qwen3_5.modeling_qwen3_5.causal_conv1d_fn"


def _tokens(n: int = 21) -> torch.Tensor:
    return torch.randint(2, 290, (1, n), generator=torch.Generator().manual_seed(0))


def test_torch_backend_runs_and_is_verified_on_cpu():
    model = tiny_target()
    with use_backend("torch", "cpu", model) as run, torch.no_grad():
        model(_tokens(), use_cache=False)
        info = run.verify()
    assert info.name == "torch"
    assert info.implementation == {"chunk": TORCH_CHUNK, "conv": TORCH_CONV}
    assert info.calls == {"chunk": 3, "conv": 3}  # 3 linear-attention layers, one forward
    assert {"torch", "transformers"} <= set(info.versions)


def test_module_globals_are_restored_after_the_block():
    originals = {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()}
    model = tiny_target()
    with pytest.raises(RuntimeError, match="boom"):
        with use_backend("torch", "cpu", model):
            assert modeling_qwen3_5.torch_chunk_gated_delta_rule is not originals["torch_chunk_gated_delta_rule"]
            raise RuntimeError("boom")
    assert {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()} == originals
    assert not model.model.layers[0].linear_attn._forward_hooks


def test_torch_function_is_the_wrapped_pure_function():
    fn = torch_function(modeling_qwen3_5, "chunk")
    assert fn is modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
    assert fn.__closure__ is None


def test_fla_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'fla'.*'cpu'.*Fix: run extraction on a CUDA GPU") as caught:
        select_backend("fla", "cpu")
    assert isinstance(caught.value, BackendUnavailable)
    with pytest.raises(BackendUnavailable, match="'fla'"):
        with use_backend("fla", "cpu", tiny_target()):
            pass


def test_unknown_backend_is_rejected():
    with pytest.raises(BackendUnavailable, match="unknown kernel backend 'triton'"):
        select_backend("triton", "cpu")


def test_a_layer_that_bypasses_the_selection_is_detected():
    model = tiny_target()
    gdn = model.model.layers[1].linear_attn
    gdn.forward = lambda hidden_states, **_: torch.zeros_like(hidden_states)  # like a hub-kernelized forward
    with use_backend("torch", "cpu", model) as run, torch.no_grad():
        model(_tokens(), use_cache=False)
        with pytest.raises(BackendMismatch, match="3 Gated DeltaNet layer forwards but 2 selected"):
            run.verify()


def test_without_a_model_the_binding_holds_but_nothing_is_verified():
    model = tiny_target()
    with use_backend("torch", "cpu") as run, torch.no_grad():
        model(_tokens(), use_cache=False)
        assert run.calls["chunk"] == 3
        with pytest.raises(BackendMismatch, match="pass the model"):
            run.verify()


def test_blocks_do_not_nest():
    model = tiny_target()
    with use_backend("torch", "cpu", model):
        with pytest.raises(BackendMismatch, match="cannot nest"):
            with use_backend("torch", "cpu", model):
                pass


@pytest.mark.skipif(
    ambient_binding(modeling_qwen3_5, "chunk") != TORCH_CHUNK,
    reason="transformers bound a kernel by itself here (fla imports)",
)
def test_torch_backend_output_equals_unpatched_torch_output():
    """Where transformers itself binds torch, forcing torch must change nothing."""
    model = tiny_target()
    with torch.no_grad():
        plain = model(_tokens(), use_cache=False).logits
        with use_backend("torch", "cpu", model) as run:
            forced = model(_tokens(), use_cache=False).logits
            run.verify()
    assert torch.equal(plain, forced)


@pytest.mark.gpu
def test_fla_and_torch_on_cuda_both_verified_and_close_but_different():
    model = tiny_target(layers=8, hidden=256).to("cuda", torch.bfloat16)
    tokens = torch.randint(2, 290, (1, 300), generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for name in ("fla", "torch"):
        with use_backend(name, "cuda", model) as run, torch.no_grad():
            results[name] = model(tokens, use_cache=False, output_hidden_states=True).hidden_states[-2][0].float()
            info = run.verify()
        assert info.calls["chunk"] == 6
        if name == "fla":  # fla's own dispatcher picks Triton, or FlashQLA where flash_qla is installed
            assert re.fullmatch(
                r"fla\.ops\.gated_delta_rule\.chunk\.chunk_gated_delta_rule\[(triton|flash_qla)\]",
                info.implementation["chunk"],
            ), info.implementation
        else:
            assert info.implementation["chunk"] == TORCH_CHUNK
    cosine = torch.nn.functional.cosine_similarity(results["fla"], results["torch"], dim=-1)
    assert cosine.mean() > 0.99
    assert not torch.equal(results["fla"], results["torch"])


@pytest.mark.gpu
def test_fla_rejects_a_model_left_on_cpu():
    model = tiny_target()
    with use_backend("fla", "cuda", model), torch.no_grad():
        with pytest.raises(BackendUnavailable, match="CPU tensors"):
            model(_tokens(), use_cache=False)


@pytest.mark.gpu
def test_fla_dispatch_registry_is_found():
    """Canary for fla internals that the recorded sub-backend ([triton] / [flash_qla]) relies on."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from dflash_eval.extract.backends import _fla_registry

    assert _fla_registry(chunk_gated_delta_rule).operation_name == "gated_delta_rule"


def test_the_test_session_binds_torch_for_every_cpu_forward_and_a_block_restores_it():
    """conftest binds torch process-wide (as the demo's builders and server do), so a CPU forward never reaches
    fla's Triton kernels where fla imports; a use_backend block rebinds for its forwards and puts it back."""
    from dflash_eval.extract import backends

    assert backends.bound_backend() == "torch"
    for role, name in ROLE_NAMES.items():
        bound = getattr(modeling_qwen3_5, name)
        assert bound.__wrapped__ is torch_function(modeling_qwen3_5, role)
    before = {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()}
    model = tiny_target()
    with use_backend("torch", "cpu", model) as run, torch.no_grad():
        model(_tokens())
        with pytest.raises(BackendMismatch, match="bind_backend inside a use_backend block"):
            backends.bind_backend("torch", "cpu")
    assert run.verify().calls
    assert {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()} == before


def test_binding_fla_on_a_cpu_is_refused_before_anything_is_bound():
    from dflash_eval.extract import backends

    before = {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()}
    with pytest.raises(BackendUnavailable, match="'fla' cannot run on device 'cpu'"):
        backends.bind_backend("fla", "cpu")
    assert {name: getattr(modeling_qwen3_5, name) for name in ROLE_NAMES.values()} == before
    assert backends.bound_backend() == "torch"
