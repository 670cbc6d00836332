"""The layout the loader resolves is the one the drafter's forward runs: hand-computed masks for each kind of layer,
and a tiny drafter whose config asks for causal or sliding layers through vLLM's keys (`dflash_config.causal`,
`use_swa`, `swa_window_size`) against dflash's own masked-attention forward with the layers set by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_eval.evaluate.blocks import BlockDrafter, visibility_rule
from dflash_eval.evaluate.drafter import load_drafter, reference_drafter
from dflash_eval.evaluate.packed import ContextPool, pack, packed_hidden
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

LAYERS = [0, 2]


def _mask(causal: bool, window: int | None, anchor: int = 4, block: int = 3) -> list[list[int]]:
    """Which keys (context 0..anchor-1, then the block) each block query sees, from visibility_rule."""
    queries = torch.arange(anchor, anchor + block)[:, None]
    keys = torch.arange(anchor + block)[None, :]
    visible = visibility_rule(SimpleNamespace(is_causal=causal, sliding_window=window), queries - keys)
    full = torch.ones(block, anchor + block, dtype=torch.bool)
    return (full if visible is None else visible).int().tolist()


def test_hand_computed_masks():
    """Anchor 4, block 3 (queries at 4, 5, 6), keys 0..6; vLLM's windows: (w-1, 0) causal, (w-1, w-1) otherwise."""
    assert _mask(False, None) == [[1] * 7] * 3
    assert _mask(True, None) == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]
    assert _mask(True, 2) == [
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]
    assert _mask(False, 2) == [
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 1, 1],
    ]


# (config.json changes, the layout expected per layer by hand from vLLM's table). The tiny drafter has a sliding
# layer (window 5) then a full one, or (window None) two full layers.
CASES = {
    "dflash_config.causal": (5, {"dflash_config": {"causal": True}}, [(True, 5), (True, None)]),
    "dflash_config.causal false": (5, {"dflash_config": {"causal": False}}, [(False, 5), (False, None)]),
    "use_swa": (None, {"dflash_config": {"use_swa": True, "swa_window_size": 3}}, [(False, 3), (False, 3)]),
    "swa_window_size": (5, {"dflash_config": {"swa_window_size": 2}}, [(True, 2), (False, None)]),
    "default": (5, {}, [(True, 5), (False, None)]),
}


def _saved(tmp_path, window, changes):
    drafter = tiny_drafter(LAYERS, window=window, block_size=6)
    drafter.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if key == "dflash_config":
            config[key].update(value)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))
    return drafter, tmp_path / "hf"


@pytest.mark.parametrize("name", list(CASES))
def test_the_forward_runs_the_resolved_layout(tmp_path, name):
    window, changes, expected = CASES[name]
    reference, path = _saved(tmp_path, window, changes)
    loaded = load_drafter(path)
    assert [(layer.causal, layer.sliding_window) for layer in loaded.attention_layout] == expected
    assert [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in loaded.model.layers] == expected
    assert [
        (layer.self_attn.is_causal, layer.self_attn.sliding_window)
        for layer in load_drafter(path, reference=True).model.layers
    ] == expected  # the reference classes, which read no dflash_config keys, run it too
    again = reference_drafter(loaded.model)  # the demo's reference loop of our weights
    assert [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in again.layers] == expected
    for layer, (causal, layer_window) in zip(reference.layers, expected):  # dflash's forward, set by hand
        layer.self_attn.is_causal, layer.self_attn.sliding_window = causal, layer_window

    target = tiny_target()
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 290, (24,), generator=generator)
    features = torch.randn(24, 2 * 64, generator=generator)
    runner = BlockDrafter(loaded.model, embed, head, MASK_ID)
    anchors = torch.arange(3, 18)
    with torch.no_grad():
        ours = runner.logits(runner.block_hidden(runner.context(features), tokens, anchors))
        for row, s in enumerate(anchors.tolist()):
            block = torch.full((1, 6), MASK_ID)
            block[0, 0] = tokens[s]
            hidden = reference(
                target_hidden=features[None, :s],
                noise_embedding=torch.nn.functional.embedding(block, embed),
                position_ids=torch.arange(s + 6)[None],
            )[:, 1:]
            torch.testing.assert_close(
                ours[row], reference.compute_logits(hidden, target.lm_head)[0], atol=2e-5, rtol=1e-5
            )
        # the evaluation's own forward (packed blocks of several anchors and sizes, the trajectory evaluator's)
        pool = ContextPool(runner, 1, 24, torch.device("cpu"), torch.float32)
        pool.write(0, runner, features)
        cos, sin = runner.rotary(24 + 7, pool.keys[0])
        grid = np.full((1, 24 + 7), -1, dtype=np.int64)
        grid[0, :24] = tokens.numpy()
        picked, sizes = np.array([3, 8, 11, 17]), np.array([6, 2, 6, 4])
        batch = pack(np.zeros(4, dtype=np.int64), picked, sizes, grid, MASK_ID, torch.device("cpu"))
        packed = runner.head_logits(packed_hidden(runner, pool, batch, cos, sin))
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for row, (s, size) in enumerate(zip(picked.tolist(), sizes.tolist())):
            block = torch.full((1, size), MASK_ID)
            block[0, 0] = tokens[s]
            hidden = reference(
                target_hidden=features[None, :s],
                noise_embedding=torch.nn.functional.embedding(block, embed),
                position_ids=torch.arange(s + size)[None],
            )
            torch.testing.assert_close(
                packed[start[row] : start[row] + size],
                reference.compute_logits(hidden, target.lm_head)[0],
                atol=2e-5,
                rtol=1e-5,
            )
        if name != "default":  # the keys change the numbers: the default layout gives other logits
            default = load_drafter(_saved(tmp_path / "plain", window, {})[1])
            plain = BlockDrafter(default.model, embed, head, MASK_ID)
            other = plain.logits(plain.block_hidden(plain.context(features), tokens, anchors))
            assert not torch.allclose(ours, other, atol=1e-4), name


def test_an_unrunnable_layout_is_refused_at_load_naming_the_file_key_and_fix(tmp_path):
    from dflash_eval.errors import DflashEvalError

    _, path = _saved(tmp_path, None, {"dflash_config": {"use_swa": True}})  # sliding everywhere, no window
    with pytest.raises(DflashEvalError) as error:
        load_drafter(path)
    message = str(error.value)
    assert str(path / "config.json") in message and "dflash_config.swa_window_size" in message
    assert "set one of them" in message
    _, path = _saved(tmp_path / "causal", 5, {"dflash_config": {"causal": "yes"}})
    with pytest.raises(DflashEvalError, match=r"dflash_config\.causal is 'yes'.*JSON boolean"):
        load_drafter(path)
