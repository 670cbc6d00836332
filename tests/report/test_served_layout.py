"""The attention layout vLLM 0.34.0 resolves for a DFlash checkpoint, by hand from qwen3_dflash.py's table, against
dflash's; and, with the wheel's source, against vLLM's own functions run on the same configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_eval.report.served_layout import (
    layout_difference,
    reference_layout,
    vllm_layout,
)

FULL, SWA = "full_attention", "sliding_attention"
CONFIGS = {
    "standard (all full)": {"num_hidden_layers": 2, "layer_types": [FULL, FULL]},
    "mixed, window": {"num_hidden_layers": 3, "layer_types": [SWA, SWA, FULL], "sliding_window": 8},
    "use_swa, no layer_types": {"num_hidden_layers": 2, "dflash_config": {"use_swa": True, "swa_window_size": 16}},
    "dflash_config.causal": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"causal": True},
    },
    "is_causal over causal": {"num_hidden_layers": 1, "is_causal": False, "dflash_config": {"causal": True}},
    "swa_window_size over sliding_window": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"swa_window_size": 6},
    },
}


def test_vllms_table_by_hand():
    assert vllm_layout(CONFIGS["standard (all full)"]) == [{"causal": False, "sliding_window": None}] * 2
    assert vllm_layout(CONFIGS["mixed, window"]) == [{"causal": True, "sliding_window": 8}] * 2 + [
        {"causal": False, "sliding_window": None}
    ]
    assert vllm_layout(CONFIGS["use_swa, no layer_types"]) == [{"causal": False, "sliding_window": 16}] * 2
    assert vllm_layout(CONFIGS["dflash_config.causal"]) == [
        {"causal": True, "sliding_window": 4},
        {"causal": True, "sliding_window": None},
    ]
    assert vllm_layout(CONFIGS["is_causal over causal"]) == [{"causal": False, "sliding_window": None}]
    with pytest.raises(ValueError, match="swa_window_size nor sliding_window"):
        vllm_layout({"num_hidden_layers": 1, "layer_types": [SWA]})


def test_the_two_agree_on_plain_checkpoints_and_differ_where_vllm_reads_more():
    assert layout_difference(CONFIGS["standard (all full)"]) is None
    assert layout_difference(CONFIGS["mixed, window"]) is None
    for name in ("use_swa, no layer_types", "dflash_config.causal", "swa_window_size over sliding_window"):
        assert "layer 0" in layout_difference(CONFIGS[name]) or "layer 1" in layout_difference(CONFIGS[name]), name
    assert reference_layout(CONFIGS["dflash_config.causal"])[1] == {"causal": False, "sliding_window": None}


@pytest.mark.skipif(
    not os.environ.get("DFLASH_EVAL_VLLM_SRC"),
    reason="set DFLASH_EVAL_VLLM_SRC (the vllm package "
    "directory of the unzipped 0.34.0 wheel) to check against vLLM's own functions",
)
def test_against_vllms_own_functions():
    """vLLM's resolution functions, cut from the wheel's qwen3_dflash.py and run on plain namespaces."""
    import ast
    import types

    source = (Path(os.environ["DFLASH_EVAL_VLLM_SRC"]) / "model_executor/models/qwen3_dflash.py").read_text()
    tree = ast.parse(source)
    wanted = [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name
        in ("_dflash_layer_causal", "_get_dflash_layer_sliding_window_and_causal", "get_dflash_layer_attn_config")
    ]
    resolver = next((n.name for n in wanted if n.name != "_dflash_layer_causal"), None)
    if resolver is None:
        resolver = next(
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and "Resolve ``(sliding_window, causal)``" in (ast.get_docstring(n) or "")
        )
        wanted.append(next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == resolver))
    module = ast.Module(body=wanted, type_ignores=[])
    scope = {"_SLIDING_ATTENTION": SWA, "Qwen3Config": object}
    exec(compile(module, "qwen3_dflash.py", "exec"), scope)  # noqa: S102 (vLLM's own code, read for the test)
    for name, config in CONFIGS.items():
        namespace = types.SimpleNamespace(
            **{"is_causal": None, "layer_types": None, "sliding_window": None, "dflash_config": None, **config}
        )
        theirs = [scope[resolver](namespace, i) for i in range(config["num_hidden_layers"])]
        ours = [(layer["sliding_window"], layer["causal"]) for layer in vllm_layout(config)]
        assert theirs == ours, name


def test_a_served_vllm_checkpoint_whose_layout_vllm_resolves_otherwise_is_a_mismatch(tmp_path):
    import json

    from dflash_eval.report.online import check_served_drafter

    served = tmp_path / "drafter"
    served.mkdir()
    (served / "config.json").write_text(json.dumps(CONFIGS["dflash_config.causal"]))
    setting = {
        "engine": "vllm",
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(served),
        "speculative_num_draft_tokens": 4,
    }
    check = check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)
    assert check["status"] == "mismatch" and "vLLM resolves" in check["problems"][0] and check["refused"]
    (served / "config.json").write_text(json.dumps(CONFIGS["mixed, window"]))
    assert (
        check_served_drafter([setting], {"path": str(served)}, 4, False, differ=lambda *_: None)["status"] == "verified"
    )
