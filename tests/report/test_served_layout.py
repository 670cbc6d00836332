"""The served-layout check: a vLLM server runs the layout the offline drafter ran (both follow vLLM's rule); SGLang
reads fewer keys, and where that changes a layer the check says which and why."""

from __future__ import annotations

import json

import pytest

from dflash_eval.report.served_layout import layout_difference

FULL, SWA = "full_attention", "sliding_attention"
# Raw config.json contents (the check completes them as transformers does).
MIXED = {"num_hidden_layers": 3, "layer_types": [SWA, SWA, FULL], "use_sliding_window": True, "sliding_window": 8}
CAUSAL = {**MIXED, "dflash_config": {"causal": True}}
USE_SWA = {"num_hidden_layers": 2, "dflash_config": {"use_swa": True, "swa_window_size": 16}}
WINDOW = {**MIXED, "dflash_config": {"swa_window_size": 4}}


def test_vllm_serves_what_was_evaluated():
    for config in (MIXED, CAUSAL, USE_SWA, WINDOW, {"num_hidden_layers": 2}):
        assert layout_difference(config, "vllm") is None


def test_sglang_agrees_on_plain_checkpoints_and_says_where_it_reads_fewer_keys():
    assert layout_difference(MIXED, "sglang") is None
    assert layout_difference({"num_hidden_layers": 2}, "sglang") is None
    causal = layout_difference(CAUSAL, "sglang")
    assert "sglang resolves" in causal and "layer 2: sglang causal=False" in causal
    assert "dflash_config.causal" in causal  # the key that decided ours
    assert "layer 0: sglang causal=False window=None" in layout_difference(USE_SWA, "sglang")
    assert "layer 0: sglang causal=True window=8, ours causal=True window=4" in layout_difference(WINDOW, "sglang")


def test_a_layout_no_engine_runs_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="layer 0 is sliding"):
        layout_difference({"num_hidden_layers": 1, "layer_types": [SWA], "sliding_window": 8})  # no use_sliding_window
    with pytest.raises(ValueError, match="engine 'trt'"):
        layout_difference(MIXED, "trt")


def test_a_served_vllm_checkpoint_resolved_as_evaluated_is_verified(tmp_path):
    """served_drafter.check_served_drafter: a vLLM server of a dflash_config.causal checkpoint runs what was evaluated."""
    from dflash_eval.report.served_drafter import check_served_drafter

    served = tmp_path / "drafter"
    served.mkdir()
    setting = {
        "engine": "vllm",
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(served),
        "speculative_num_draft_tokens": 4,
    }
    for config in (CAUSAL, MIXED):
        (served / "config.json").write_text(json.dumps(config))
        check = check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)
        assert check["status"] == "verified", check
    (served / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "layer_types": [SWA]}))
    check = check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)
    assert check["status"] == "mismatch" and "layer 0 is sliding" in check["problems"][0]


def test_an_sglang_server_of_a_dflash_config_causal_checkpoint_is_a_mismatch_naming_the_layer(tmp_path):
    """served_drafter.check_served_drafter on SGLang's records (they name no engine): SGLang reads no dflash_config.causal, so
    it runs layer 2 non-causal where the evaluation ran it causal; a plain checkpoint stays verified."""
    from dflash_eval.report.served_drafter import check_served_drafter

    served = tmp_path / "drafter"
    served.mkdir()
    setting = {
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(served),
        "speculative_num_draft_tokens": 4,
    }
    (served / "config.json").write_text(json.dumps(MIXED))
    check = check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)
    assert check["status"] == "verified", check
    (served / "config.json").write_text(json.dumps(CAUSAL))
    check = check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)
    assert check["status"] == "mismatch" and "layer 2: sglang causal=False" in check["problems"][0], check
    assert check["refused"]
