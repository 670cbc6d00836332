"""A drafter's layer list when config.yaml gives none: read from its config.json by the rule the evaluation reads it
with (checkpoint.checkpoint_facts), so the workflow's layer set and the evaluation's check cannot disagree."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from dflash_eval.checkpoint import checkpoint_facts
from dflash_eval.drafters import drafter_layer_ids
from dflash_eval.errors import DflashEvalError


def _config(path, ids, nested=True):
    path.write_text(json.dumps({"dflash_config": {"target_layer_ids": ids}} if nested else {"target_layer_ids": ids}))


def _drafters(**spec):
    return {"drafters": {"d": {"layer_ids": None, "config": None, "layout": "auto", **spec}}}


def test_config_yaml_wins_then_the_checkpoints_own_config_json(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    _config(hf / "config.json", [1, 5, 9])
    safetensors.torch.save_file({"fc.weight": torch.zeros(2, 6)}, str(hf / "model.safetensors"))
    assert drafter_layer_ids(_drafters(path=str(hf), layer_ids=[2, 3]), "d") == [2, 3]
    assert drafter_layer_ids(_drafters(path=str(hf)), "d") == [1, 5, 9]

    pt = tmp_path / "run" / "step_10.pt"  # a bare .pt: its `config:`, else the config.json beside it
    pt.parent.mkdir()
    pt.write_bytes(b"")
    _config(pt.parent / "config.json", [4, 7], nested=False)
    other = tmp_path / "other.json"
    _config(other, [3, 8])
    assert drafter_layer_ids(_drafters(path=str(pt)), "d") == [4, 7]
    assert drafter_layer_ids(_drafters(path=str(pt), config=str(other)), "d") == [3, 8]
    assert checkpoint_facts(hf).layer_ids == drafter_layer_ids(_drafters(path=str(hf)), "d"), "the evaluation's"


def test_a_directory_without_its_config_json_is_an_error_naming_the_key_not_its_parents_list(tmp_path):
    """The workflow used to fall back to the parent directory's config.json, which the evaluation never reads."""
    _config(tmp_path / "config.json", [1, 2])
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(
        DflashEvalError, match=r"drafters\.d: cannot tell its target layers .* set drafters\.d\.layer_ids"
    ):
        drafter_layer_ids(_drafters(path=str(hf)), "d")
    (hf / "config.json").write_text(json.dumps({"block_size": 4}))
    with pytest.raises(DflashEvalError, match=r"config\.json has no dflash_config\.target_layer_ids"):
        drafter_layer_ids(_drafters(path=str(hf)), "d")
