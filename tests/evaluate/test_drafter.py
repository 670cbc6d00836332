"""Strict drafter loading: every layout, and loud errors instead of silent skips."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.drafter import load_drafter
from tests.support.tiny import tiny_drafter

LAYERS = [0, 2]


class PickledNote:
    """Something a training script might pickle next to its weights."""


@pytest.fixture()
def saved(tmp_path):
    model = tiny_drafter(LAYERS)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return model, tmp_path


def _same_weights(a, b):
    return all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_hf_directory(saved):
    model, root = saved
    loaded = load_drafter(root / "hf")
    assert loaded.layout == "hf" and loaded.layer_ids == LAYERS and loaded.block_size == 4
    assert _same_weights(model, loaded.model)


@pytest.mark.parametrize("wrapper", ["model_state_dict", "state_dict", None])
@pytest.mark.parametrize("prefix", ["", "module.", "model."])
def test_training_checkpoint_layouts(saved, wrapper, prefix):
    model, root = saved
    state = {prefix + k: v for k, v in model.state_dict().items()}
    payload = state if wrapper is None else {wrapper: state, "global_step": 1234, "epoch": 1.5}
    torch.save(payload, root / "ckpt.pt")
    loaded = load_drafter(root / "ckpt.pt", config=root / "hf" / "config.json")
    assert _same_weights(model, loaded.model)
    if wrapper is not None:
        assert loaded.global_step == 1234 and loaded.epoch == 1.5


def test_bare_safetensors_with_config(saved):
    model, root = saved
    save_file(model.state_dict(), str(root / "bare.safetensors"))
    loaded = load_drafter(root / "bare.safetensors", config=root / "hf")
    assert _same_weights(model, loaded.model)


def test_missing_unexpected_and_misshaped_keys_are_listed(saved):
    model, root = saved
    state = dict(model.state_dict())
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(2)
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    torch.save({"model_state_dict": state}, root / "bad.pt")
    with pytest.raises(DflashEvalError) as error:
        load_drafter(root / "bad.pt", config=root / "hf")
    message = str(error.value)
    assert "missing: norm.weight" in message and "unexpected: extra.weight" in message
    assert "layers.0.mlp.up_proj.weight: checkpoint (3, 3) vs model (128, 64)" in message


def test_fc_width_must_match_layer_count(saved):
    """The seed write-up's bug: a 5-layer fc evaluated with 4 layers of states."""
    model, root = saved
    config = json.loads((root / "hf" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (root / "three.json").write_text(json.dumps(config))
    torch.save({"model_state_dict": model.state_dict()}, root / "two.pt")
    with pytest.raises(DflashEvalError, match=r"takes 2 target layers but target_layer_ids \[0, 1, 2\] has 3"):
        load_drafter(root / "two.pt", config=root / "three.json")


def test_config_yaml_layers_must_agree_with_checkpoint(saved):
    _, root = saved
    with pytest.raises(DflashEvalError, match=r"config.yaml says layer_ids \[1, 2\]"):
        load_drafter(root / "hf", layer_ids=[1, 2])


def test_pickle_needs_opt_in(saved, tmp_path):
    model, root = saved

    # an arbitrary (importable) object forces a pickle that weights_only refuses
    torch.save({"model_state_dict": model.state_dict(), "note": PickledNote()}, root / "pickled.pt")
    with pytest.raises(DflashEvalError, match="allow_pickle: true"):
        load_drafter(root / "pickled.pt", config=root / "hf")


def test_mask_token_outside_vocab(saved):
    _, root = saved
    with pytest.raises(DflashEvalError, match="outside the target vocabulary"):
        load_drafter(root / "hf", vocab_size=100)


def test_dflash2_directory_with_the_selectors_bare_codebook_keys(tmp_path):
    """A DFlash2DraftModel is built from its config; codebooks saved without `.weight` still load."""
    from safetensors.torch import load_file

    model = tiny_drafter(LAYERS, dflash2=True)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    weights = tmp_path / "hf" / "model.safetensors"
    state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in load_file(weights).items()}
    save_file(state, weights, metadata={"format": "pt"})
    loaded = load_drafter(tmp_path / "hf")
    assert type(loaded.model).__name__ == "DFlash2DraftModel"
    assert _same_weights(model, loaded.model)


def test_dflash2_config_without_its_settings_names_them(tmp_path):
    model = tiny_drafter(LAYERS, dflash2=True)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    del config["dflash_config"]["selector_rank"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(DflashEvalError, match="selector_rank"):
        load_drafter(tmp_path / "hf")
