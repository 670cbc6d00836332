"""evaluate.drafter_model (torch alone) against `dflash.model`'s classes: one checkpoint loaded into both gives the
same parameters, the same facts and, through BlockDrafter and the packed forward, the same bits."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_eval.attention_layout import LayoutError
from dflash_eval.evaluate import drafter_model
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.drafter import load_drafter, reference_drafter
from dflash_eval.evaluate.packed import ContextPool, pack, packed_hidden
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

LAYERS = [0, 2]


def _both(tmp_path, dflash2: bool, window: int | None, block_size: int = 6):
    """The same saved checkpoint loaded into ours and into the reference classes."""
    model = tiny_drafter(LAYERS, window=window, block_size=block_size, dflash2=dflash2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours, reference = load_drafter(tmp_path / "hf"), load_drafter(tmp_path / "hf", reference=True)
    assert isinstance(ours.model, drafter_model.DFlashDraftModel)
    assert type(reference.model).__module__ == "dflash.model"
    assert type(ours.model).__name__ == type(reference.model).__name__ == type(model).__name__
    return ours, reference


def _runners(ours, reference, dtype=torch.float32):
    target = tiny_target()
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    return [BlockDrafter(loaded.model, embed, head, MASK_ID).to(dtype=dtype) for loaded in (ours, reference)]


VARIANTS = [(False, 5), (False, None), (True, 5), (True, None)]
IDS = ["dflash-sliding", "dflash-full", "dflash2-sliding", "dflash2-full"]


@pytest.mark.parametrize("dflash2, window", VARIANTS, ids=IDS)
def test_same_parameters_and_facts(tmp_path, dflash2, window):
    ours, reference = _both(tmp_path, dflash2, window)
    mine, theirs = ours.model.state_dict(), reference.model.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine)
    assert [n for n, _ in ours.model.named_buffers()] == ["rotary_emb.inv_freq"]  # (no original_inv_freq: no
    # dynamic RoPE)
    assert torch.equal(ours.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        assert getattr(ours.model, name) == getattr(reference.model, name)
    assert (ours.layer_ids, ours.block_size, ours.mask_token_id) == (
        reference.layer_ids,
        reference.block_size,
        reference.mask_token_id,
    )
    for a, b in zip(ours.model.layers, reference.model.layers):
        for name in ("head_dim", "num_key_value_groups", "scaling", "is_causal", "sliding_window"):
            assert getattr(a.self_attn, name) == getattr(b.self_attn, name), name
        for norm in (a.self_attn.q_norm, a.input_layernorm):
            assert norm.variance_epsilon == b.self_attn.q_norm.variance_epsilon
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [window, None]
    if dflash2:
        assert ours.model.candidate_selector.top_k == reference.model.candidate_selector.top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dflash2, window", VARIANTS, ids=IDS)
def test_block_drafter_gives_the_same_bits(tmp_path, dflash2, window, dtype):
    """Context keys and values, block states, logits and drafts: torch.equal, not close."""
    ours, reference = _both(tmp_path, dflash2, window)
    runners = _runners(ours, reference, dtype)
    generator = torch.Generator().manual_seed(3)
    length = 23
    features = (torch.randn(length, 2 * 64, generator=generator) * 3).to(dtype)
    tokens = torch.randint(2, 290, (length,), generator=generator)
    anchors = torch.tensor([1, 4, 9, 15, 22])
    results = []
    with torch.no_grad():
        for runner in runners:
            context = runner.context(features)
            hidden = runner.block_hidden(context, tokens, anchors)
            short = runner.block_hidden(context, tokens, anchors, block_size=3)
            logits = runner.logits(hidden)
            results.append(
                [
                    *(t for layer in context.layers for t in (layer.keys, layer.values)),
                    context.cos,
                    context.sin,
                    hidden,
                    short,
                    logits,
                    runner.draft_tokens(hidden, logits, tokens[anchors]),
                ]
            )
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][-1].unique().numel() > 3  # the drafts are not a constant


@pytest.mark.parametrize("dflash2, window", VARIANTS, ids=IDS)
def test_packed_forward_gives_the_same_bits(tmp_path, dflash2, window):
    ours, reference = _both(tmp_path, dflash2, window)
    generator = torch.Generator().manual_seed(0)
    lengths = [20, 31, 17]
    features = [torch.randn(n, 128, generator=generator) for n in lengths]
    tokens = np.full((len(lengths), 40), -1, dtype=np.int64)
    for slot, n in enumerate(lengths):
        tokens[slot, :n] = torch.randint(2, 290, (n,), generator=generator).numpy()
    slot, anchor, size = np.array([0, 0, 1, 1, 2, 2]), np.array([3, 15, 4, 25, 2, 14]), np.array([6, 2, 3, 6, 4, 6])
    results = []
    with torch.no_grad():
        for runner in _runners(ours, reference):
            pool = ContextPool(runner, len(lengths), max(lengths), torch.device("cpu"), torch.float32)
            for s, f in enumerate(features):
                pool.write(s, runner, f)
            cos, sin = runner.rotary(40, pool.keys[0])
            batch = pack(slot, anchor, size, tokens, MASK_ID, torch.device("cpu"))
            hidden = packed_hidden(runner, pool, batch, cos, sin)
            results.append([hidden, runner.head_logits(hidden)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_reference_forward_of_our_weights_is_the_reference(tmp_path):
    """reference_drafter (the demo's reference loop) holds our weights in dflash's class, once per set of weights."""
    ours, reference = _both(tmp_path, False, 5)
    again = reference_drafter(ours.model)
    assert type(again) is type(reference.model)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.model.state_dict().values()))
    assert reference_drafter(ours.model) is again and reference_drafter(reference.model) is reference.model
    ours.model.to(torch.bfloat16)
    moved = reference_drafter(ours.model)
    assert moved is not again and next(moved.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "values",
    [
        {"rope_theta": 1e6, "use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1},
        {"use_sliding_window": False, "sliding_window": 7, "layer_types": ["sliding_attention", "full_attention"]},
        {"num_key_value_heads": None, "rope_scaling": {"rope_type": "default", "rope_theta": 500.0}},
        {
            "head_dim": 24,
            "is_causal": False,
            "layer_types": ["sliding_attention", "sliding_attention"],
            "use_sliding_window": True,
            "sliding_window": 4,
        },
    ],
    ids=["max-window-layers", "window-off", "rope-scaling", "non-causal"],
)
def test_config_completed_as_qwen3_completes_it(values):
    """What the modules read of a config, against transformers' Qwen3Config of the same config.json."""
    base = {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 64,
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1]},
    }
    ours = drafter_model.DrafterConfig({**base, **values})
    theirs = ours.reference_config()
    for name in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "layer_types",
        "sliding_window",
        "rms_norm_eps",
        "attention_bias",
        "hidden_act",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "rope_parameters",
        "dflash_config",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert getattr(ours, "is_causal", None) == getattr(theirs, "is_causal", None)
    from dflash.model import DFlashDraftModel

    if "sliding_attention" in ours.layer_types and ours.sliding_window is None:
        # dflash runs such a layer causal and windowless; vLLM (whose layout ours runs) and SGLang refuse it
        with pytest.raises(LayoutError, match="layer 0 is sliding"):
            drafter_model.DFlashDraftModel(ours)
        return
    mine, reference = drafter_model.DFlashDraftModel(ours), DFlashDraftModel(theirs)
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    for a, b in zip(mine.layers, reference.layers):
        assert (a.self_attn.is_causal, a.self_attn.sliding_window) == (
            b.self_attn.is_causal,
            b.self_attn.sliding_window,
        )
    positions = torch.arange(40)[None]
    x = torch.zeros(1, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(mine.rotary_emb(x, positions), reference.rotary_emb(x, positions)))


def test_another_rope_kind_is_transformers_own():
    config = drafter_model.DrafterConfig(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "head_dim": 16,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        }
    )
    assert type(drafter_model.rotary_embedding(config)).__name__ == "Qwen3RotaryEmbedding"


def test_the_evaluate_stage_imports_neither_transformers_nor_dflash():
    code = (
        "import sys, dflash_eval.evaluate.stage; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('transformers', 'dflash')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == []
