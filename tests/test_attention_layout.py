"""A DFlash checkpoint's attention layout: vLLM 0.34.0's and SGLang 0.5.23's by hand from their source's tables, and,
with the wheels' sources, against their own functions run on the same configs; the refusals name the key."""

from __future__ import annotations

import ast
import os
import types
from pathlib import Path

import pytest

from dflash_eval.attention_layout import (
    LayoutError,
    check_runnable,
    completed,
    sglang_layout,
    vllm_layout,
)

FULL, SWA = "full_attention", "sliding_attention"
# Completed configs (what the engines' code reads: transformers' Qwen3Config after completion).
CONFIGS = {
    "standard (all full)": {"num_hidden_layers": 2, "layer_types": [FULL, FULL]},
    "mixed, window": {"num_hidden_layers": 3, "layer_types": [SWA, SWA, FULL], "sliding_window": 8},
    "use_swa over all-full": {
        "num_hidden_layers": 2,
        "layer_types": [FULL, FULL],
        "dflash_config": {"use_swa": True, "swa_window_size": 16},
    },
    "use_swa, mixed types": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"use_swa": True},
    },
    "dflash_config.causal": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"causal": True},
    },
    "dflash_config.causal false": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"causal": False},
    },
    "is_causal over causal": {
        "num_hidden_layers": 1,
        "layer_types": [FULL],
        "is_causal": False,
        "dflash_config": {"causal": True},
    },
    "swa_window_size over sliding_window": {
        "num_hidden_layers": 2,
        "layer_types": [SWA, FULL],
        "sliding_window": 4,
        "dflash_config": {"swa_window_size": 6},
    },
}


def _pairs(layers):
    return [(layer.causal, layer.sliding_window) for layer in layers]


def test_vllms_table_by_hand():
    """qwen3_dflash.py:139-155's table, each case typed out."""
    assert _pairs(vllm_layout(CONFIGS["standard (all full)"])) == [(False, None)] * 2
    assert _pairs(vllm_layout(CONFIGS["mixed, window"])) == [(True, 8), (True, 8), (False, None)]
    assert _pairs(vllm_layout(CONFIGS["use_swa over all-full"])) == [(False, 16)] * 2
    assert _pairs(vllm_layout(CONFIGS["use_swa, mixed types"])) == [(True, 4), (False, None)]  # types win
    assert _pairs(vllm_layout(CONFIGS["dflash_config.causal"])) == [(True, 4), (True, None)]
    assert _pairs(vllm_layout(CONFIGS["dflash_config.causal false"])) == [(False, 4), (False, None)]
    assert _pairs(vllm_layout(CONFIGS["is_causal over causal"])) == [(False, None)]
    assert _pairs(vllm_layout(CONFIGS["swa_window_size over sliding_window"])) == [(True, 6), (False, None)]


def test_the_deciding_keys_are_named():
    layers = vllm_layout(CONFIGS["dflash_config.causal"])
    assert (layers[0].causal_from, layers[0].sliding_from, layers[0].window_from) == (
        "dflash_config.causal",
        "layer_types",
        "sliding_window",
    )
    assert layers[1].window_from is None
    swa = vllm_layout(CONFIGS["use_swa over all-full"])[0]
    assert (swa.causal_from, swa.sliding_from, swa.window_from) == (
        "layer_types",
        "dflash_config.use_swa",
        "dflash_config.swa_window_size",
    )
    assert vllm_layout(CONFIGS["is_causal over causal"])[0].causal_from == "is_causal"


def test_sglang_reads_fewer_keys():
    """SGLang: is_causal, else causal iff sliding; sliding from layer_types; the window sliding_window."""
    assert _pairs(sglang_layout(CONFIGS["mixed, window"])) == _pairs(vllm_layout(CONFIGS["mixed, window"]))
    assert _pairs(sglang_layout(CONFIGS["dflash_config.causal"])) == [(True, 4), (False, None)]
    assert _pairs(sglang_layout(CONFIGS["use_swa over all-full"])) == [(False, None)] * 2
    assert _pairs(sglang_layout(CONFIGS["swa_window_size over sliding_window"])) == [(True, 4), (False, None)]


def test_completed_as_transformers_completes_it():
    from transformers import Qwen3Config

    for raw in (
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1},
        {"num_hidden_layers": 2, "sliding_window": 7, "layer_types": [SWA, FULL]},
        {"num_hidden_layers": 2},
        {"num_hidden_layers": 4, "use_sliding_window": True},
    ):
        theirs = Qwen3Config(**raw)
        ours = completed(raw)
        assert (ours["sliding_window"], ours["layer_types"]) == (theirs.sliding_window, theirs.layer_types), raw


@pytest.mark.parametrize(
    "config, words",
    [
        (
            {"num_hidden_layers": 1, "layer_types": [SWA]},
            ["layer 0 is sliding", "swa_window_size", "use_sliding_window"],
        ),
        ({"num_hidden_layers": 2, "layer_types": [SWA]}, ["layer_types", "one entry per layer"]),
        ({"num_hidden_layers": 1, "layer_types": ["linear_attention"]}, ["linear_attention"]),
        ({"num_hidden_layers": 1, "layer_types": [FULL], "is_causal": "false"}, ["is_causal is 'false'"]),
        (
            {"num_hidden_layers": 1, "layer_types": [FULL], "dflash_config": {"use_swa": True, "swa_window_size": 0}},
            ["dflash_config.swa_window_size is 0"],
        ),
    ],
    ids=["no-window", "short-types", "unknown-type", "string-flag", "zero-window"],
)
def test_an_unrunnable_layout_is_refused_naming_the_key(config, words):
    with pytest.raises(LayoutError) as error:
        vllm_layout(config)
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"dflash_config": {"attention_sink_bias": True}}, "dflash_config.attention_sink_bias"),
        ({"add_swa_attention_sink_bias": True}, "add_swa_attention_sink_bias"),
        ({"dflash_config": {"attention_value_scale": 0.5}}, "dflash_config.attention_value_scale"),
        ({"is_neox_style": False}, "is_neox_style"),
    ],
)
def test_keys_that_change_attention_otherwise_are_refused(extra, key):
    with pytest.raises(LayoutError, match=key.replace(".", r"\.")):
        check_runnable({"num_hidden_layers": 1, **extra})
    # dflash_config's flag wins over the top-level one, as in vLLM (qwen3_dflash.py:349-353)
    check_runnable({"add_swa_attention_sink_bias": True, "dflash_config": {"attention_sink_bias": False}})


def _functions(source: Path, names: set[str]) -> ast.Module:
    tree = ast.parse(source.read_text())
    return ast.Module(
        body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names], type_ignores=[]
    )


def _namespace(config: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        **{"is_causal": None, "layer_types": None, "sliding_window": None, "dflash_config": None, **config}
    )


@pytest.mark.skipif(not os.environ.get("DFLASH_EVAL_VLLM_SRC"), reason="set DFLASH_EVAL_VLLM_SRC (the 0.34.0 wheel)")
def test_against_vllms_own_functions():
    """vLLM's resolution functions, cut from the wheel's qwen3_dflash.py and run on plain namespaces."""
    source = Path(os.environ["DFLASH_EVAL_VLLM_SRC"]) / "model_executor/models/qwen3_dflash.py"
    scope = {"_SLIDING_ATTENTION": SWA, "Qwen3Config": object}
    module = _functions(source, {"_dflash_layer_causal", "_resolve_layer_attention"})
    assert len(module.body) == 2, "vLLM's resolver functions moved: read qwen3_dflash.py again"
    exec(compile(module, str(source), "exec"), scope)  # noqa: S102 (vLLM's own code, read for the test)
    for name, config in CONFIGS.items():
        theirs = [scope["_resolve_layer_attention"](_namespace(config), i) for i in range(config["num_hidden_layers"])]
        assert theirs == [(window, causal) for causal, window in _pairs(vllm_layout(config))], name
    with pytest.raises(ValueError, match="window size"):
        scope["_resolve_layer_attention"](_namespace({"layer_types": [SWA]}), 0)


@pytest.mark.skipif(not os.environ.get("DFLASH_EVAL_SGLANG_SRC"), reason="set DFLASH_EVAL_SGLANG_SRC (0.5.23)")
def test_against_sglangs_own_functions():
    """SGLang's models/dflash.py and dflash_utils.py resolvers, cut from the wheel, run on the same configs."""
    import enum

    root = Path(os.environ["DFLASH_EVAL_SGLANG_SRC"])
    utils = _functions(
        root / "speculative/dflash_utils.py",
        {"get_dflash_layer_types", "get_dflash_attention_sliding_window_size", "_cfg_get", "_get_text_config"},
    )
    model = _functions(root / "models/dflash.py", {"_get_dflash_attention_type", "_get_dflash_layer_attention_params"})
    kind = enum.Enum("AttentionType", ["DECODER", "ENCODER_ONLY"])
    scope = {
        "Any": object,
        "Optional": object,
        "Sequence": __import__("collections.abc").abc.Sequence,
        "Tuple": tuple,
        "AttentionType": kind,
        "is_nemotron_35_draft_config": lambda config: False,
        "_get_dflash_config": lambda config: {},
    }
    exec(compile(utils, "dflash_utils.py", "exec"), scope)  # noqa: S102 (SGLang's own code, read for the test)
    exec(compile(model, "dflash.py", "exec"), scope)  # noqa: S102
    for name, config in CONFIGS.items():
        namespace = _namespace(config)
        namespace.get_text_config = lambda ns=namespace: ns
        theirs = [scope["_get_dflash_layer_attention_params"](namespace, i) for i in range(config["num_hidden_layers"])]
        ours = [
            (-1 if w is None else w - 1, kind.DECODER if c else kind.ENCODER_ONLY)
            for c, w in _pairs(sglang_layout(config))
        ]
        assert theirs == ours, name
