"""Broken checkpoints are refused by name: NaN/Inf weights (drafter and target head), truncated safetensors, pickled
code (without terminal escapes); the header-only checks the workflow runs at load agree with the loader."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_eval.checkpoint import check_checkpoint, checkpoint_facts
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.target_head import load_target_head
from tests.support.tiny import tiny_drafter, tiny_target

LAYERS = [0, 2]


class PickledNote:
    """Something a training script might pickle next to its weights."""


@pytest.fixture()
def hf(tmp_path):
    tiny_drafter(LAYERS).save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf"


def _poison(file, key, value):
    state = load_file(file)
    state[key] = state[key].clone()
    state[key].view(-1)[3] = value
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_drafter_weight_is_refused_naming_the_tensor(hf, value):
    weights = hf / "model.safetensors"
    _poison(weights, "fc.weight", value)
    before = weights.read_bytes()
    kind = "1 NaN, 0 Inf" if math.isnan(value) else "0 NaN, 1 Inf"
    with pytest.raises(DflashEvalError, match=rf"non-finite weights in fc.weight \({kind} of \d+ values\)"):
        load_drafter(hf)
    assert weights.read_bytes() == before


def test_a_non_finite_weight_in_a_training_checkpoint_is_refused(hf, tmp_path):
    model = tiny_drafter(LAYERS)
    state = {f"module.{k}": v.clone() for k, v in model.state_dict().items()}
    state["module.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    torch.save({"model_state_dict": state}, tmp_path / "step.pt")
    with pytest.raises(DflashEvalError, match=r"non-finite weights in module.layers.1.mlp.down_proj.weight"):
        load_drafter(tmp_path / "step.pt", config=hf)


def test_a_non_finite_target_head_is_refused_naming_the_tensor(tmp_path):
    tiny_target().save_pretrained(tmp_path / "target")
    _poison(tmp_path / "target" / "model.safetensors", "lm_head.weight", float("nan"))
    with pytest.raises(DflashEvalError, match=r"model.safetensors: non-finite weights in lm_head.weight \(1 NaN"):
        load_target_head(tmp_path / "target")


def test_a_truncated_drafter_is_named_by_the_loader_and_by_the_load_time_check(hf):
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])  # a copy that stopped early
    for read in (lambda: load_drafter(hf), lambda: checkpoint_facts(hf)):
        with pytest.raises(
            DflashEvalError,
            match=rf"{weights}: {len(data) - 100} bytes, but its header says "
            rf"{len(data)}: the file is truncated; copy the checkpoint again",
        ):
            read()
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(DflashEvalError, match="not a safetensors file"):
        load_drafter(hf)


def test_the_pickle_refusal_names_what_it_refused_without_terminal_escapes(hf, tmp_path):
    torch.save({"model_state_dict": tiny_drafter(LAYERS).state_dict(), "note": PickledNote()}, tmp_path / "p.pt")
    with pytest.raises(DflashEvalError) as error:
        load_drafter(tmp_path / "p.pt", config=hf)
    message = str(error.value)
    assert "\x1b" not in message
    assert "Unsupported global: GLOBAL tests.evaluate.test_drafter_faults.PickledNote" in message
    assert "set `allow_pickle: true`" in message


def test_header_checks_find_what_the_loader_finds_without_reading_weights(hf, tmp_path):
    """The checks the workflow runs at load (config.json + safetensors header) and the loader agree."""
    facts = checkpoint_facts(hf)
    assert facts.layer_ids == LAYERS and facts.shapes["fc.weight"] == [64, 128]
    assert check_checkpoint(facts, LAYERS, {"hidden_size": 64, "vocab_size": 300}) == LAYERS
    config = json.loads((hf / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    (tmp_path / "three.json").write_text(json.dumps(config))
    save_file(load_file(hf / "model.safetensors"), tmp_path / "bare.safetensors")
    three = checkpoint_facts(tmp_path / "bare.safetensors", config=tmp_path / "three.json")
    width = r"fc.weight \(64, 128\) takes 2 target layers but target_layer_ids \[0, 1, 2\] has 3"
    with pytest.raises(DflashEvalError, match=width):
        check_checkpoint(three, None, None)
    with pytest.raises(DflashEvalError, match=width):
        load_drafter(tmp_path / "bare.safetensors", config=tmp_path / "three.json")
    with pytest.raises(DflashEvalError, match=r"config.yaml says layer_ids \[1, 2\] but the drafter config"):
        check_checkpoint(facts, [1, 2], None)
    with pytest.raises(DflashEvalError, match="drafter hidden_size 64 != target hidden size 32"):
        check_checkpoint(facts, None, {"hidden_size": 32})
    with pytest.raises(DflashEvalError, match="mask_token_id 299 is outside the target vocabulary"):
        check_checkpoint(facts, None, {"vocab_size": 100})


def test_a_stray_safetensors_file_beside_model_safetensors_is_named_not_ignored(tmp_path):
    """Before, only model.safetensors was read and any other weights file in the directory was ignored silently."""
    from dflash_eval.checkpoint import weight_files

    (tmp_path / "model.safetensors").write_bytes(b"")
    assert weight_files(tmp_path, "hf") == [tmp_path / "model.safetensors"]
    (tmp_path / "model-step2.safetensors").write_bytes(b"")
    with pytest.raises(
        DflashEvalError,
        match=r"holds model.safetensors and also model-step2.safetensors; only "
        r"model.safetensors would be read",
    ):
        weight_files(tmp_path, "hf")
