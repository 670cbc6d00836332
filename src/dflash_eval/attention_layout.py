"""A DFlash checkpoint's attention layout per layer (causal or not inside the block, a sliding window or none), as
vLLM 0.34.0, SGLang 0.5.23 and dflash 0.1.0 each resolve it from config.json.

All three read the config as transformers' Qwen3Config completes it (`completed`): `sliding_window` is None unless
`use_sliding_window`, `layer_types` defaults to sliding from `max_window_layers` on. The evaluation runs vLLM's
layout (evaluate/drafter.py); the report says where an engine resolves the served checkpoint otherwise. The rules,
with their source lines: docs/vllm_protocol.md ("The drafter's attention layout").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
VLLM_RULE = "vLLM 0.34.0 (model_executor/models/qwen3_dflash.py: _dflash_layer_causal, _resolve_layer_attention)"


class LayoutError(ValueError):
    """A layout that cannot run: the key, its value and the fix are in the message."""


@dataclass(frozen=True)
class LayerLayout:
    """One layer's attention: causal inside the block or not, its window (None: full), and the keys that decided."""

    causal: bool
    sliding_window: int | None
    causal_from: str  # "is_causal" | "dflash_config.causal" | "layer_types" | "default"
    sliding_from: str  # "layer_types" | "dflash_config.use_swa" | "default"
    window_from: str | None  # "dflash_config.swa_window_size" | "sliding_window" | None (a full layer)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def completed(values: Mapping[str, Any]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as transformers' Qwen3Config completes them (defaults 4096 and 28)."""
    out = dict(values)
    use_window = bool(out.get("use_sliding_window", False))
    out["sliding_window"] = out.get("sliding_window", 4096) if use_window else None
    if out.get("layer_types") is None:
        start = out.get("max_window_layers", 28)
        out["layer_types"] = [
            SLIDING if out["sliding_window"] is not None and i >= start else FULL
            for i in range(int(out.get("num_hidden_layers", 32)))
        ]
    return out


def _dflash(config: Mapping[str, Any]) -> dict[str, Any]:
    return config.get("dflash_config") or {}


def _flag(config: Mapping[str, Any], key: str) -> bool | None:
    """A boolean key (`dflash_config.x` for a dotted name), None when unset; another type is refused (vLLM's bool()
    would read the string "false" as true)."""
    value = _dflash(config).get(key.split(".", 1)[1]) if key.startswith("dflash_config.") else config.get(key)
    if value is not None and not isinstance(value, bool):
        raise LayoutError(f"{key} is {value!r}: it must be true, false or absent; write a JSON boolean")
    return value


def _causal(config: Mapping[str, Any], i: int) -> tuple[bool, str]:
    """vLLM's causality of layer i (qwen3_dflash.py:86-97)."""
    for key in ("is_causal", "dflash_config.causal"):
        value = _flag(config, key)
        if value is not None:
            return value, key
    layer_types = config.get("layer_types")
    if not layer_types:
        return False, "default"
    return layer_types[i] == SLIDING, "layer_types"


def _window(config: Mapping[str, Any], i: int, default_key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(
            f"layer {i} is sliding, and {default_key} is {value!r}: a sliding layer needs a window of at least 1 token;"
            " set dflash_config.swa_window_size or use_sliding_window with sliding_window"
        )
    return value


def vllm_layout(config: Mapping[str, Any]) -> list[LayerLayout]:
    """Per layer, as vLLM 0.34.0 resolves it (qwen3_dflash.py:139-187) on a completed config."""
    check_layer_types(config)
    dflash = _dflash(config)
    layer_types = config.get("layer_types")
    use_swa = bool(_flag(config, "dflash_config.use_swa"))
    any_sliding = layer_types is not None and SLIDING in layer_types
    out = []
    for i in range(int(config["num_hidden_layers"])):
        if layer_types is None or (use_swa and not any_sliding):  # use_swa makes every layer sliding
            sliding, sliding_from = use_swa, "dflash_config.use_swa" if use_swa else "default"
        else:
            sliding, sliding_from = layer_types[i] == SLIDING, "layer_types"
        window, window_from = None, None
        if sliding:
            window_from = "dflash_config.swa_window_size" if "swa_window_size" in dflash else "sliding_window"
            value = dflash.get("swa_window_size", config.get("sliding_window"))
            if value is None:
                raise LayoutError(
                    f"layer {i} is sliding ({sliding_from}) but neither dflash_config.swa_window_size nor "
                    "sliding_window is set (sliding_window counts only with use_sliding_window: true); vLLM refuses "
                    "such a checkpoint: set one of them"
                )
            window = _window(config, i, window_from, value)
        causal, causal_from = _causal(config, i)
        out.append(LayerLayout(causal, window, causal_from, sliding_from, window_from))
    return out


def sglang_layout(config: Mapping[str, Any]) -> list[LayerLayout]:
    """Per layer, as SGLang 0.5.23 resolves it (models/dflash.py:157-191, speculative/dflash_utils.py:388-417):
    `is_causal`, else causal iff sliding; sliding from `layer_types` alone; the window `sliding_window`. It reads
    no `dflash_config.causal`, `use_swa` or `swa_window_size` (the last only for Nemotron 3.5 drafters)."""
    check_layer_types(config)
    out = []
    for i, kind in enumerate(config["layer_types"]):
        is_causal = _flag(config, "is_causal")
        causal, causal_from = (kind == SLIDING, "layer_types") if is_causal is None else (is_causal, "is_causal")
        window = None
        if kind == SLIDING:
            if config.get("sliding_window") is None:
                raise LayoutError(f"layer {i} is sliding but sliding_window is unset: SGLang refuses the checkpoint")
            window = _window(config, i, "sliding_window", config["sliding_window"])
        out.append(LayerLayout(causal, window, causal_from, "layer_types", "sliding_window" if window else None))
    return out


def check_layer_types(config: Mapping[str, Any]) -> None:
    """One known entry per layer, else an error naming the key."""
    layer_types, layers = config.get("layer_types"), int(config["num_hidden_layers"])
    if layer_types is None:
        return
    if isinstance(layer_types, str) or len(layer_types) != layers:
        raise LayoutError(
            f"layer_types is {layer_types!r}: it must list one entry per layer ({layers}, num_hidden_layers)"
        )
    unknown = sorted({str(kind) for kind in layer_types} - {SLIDING, FULL})
    if unknown:
        raise LayoutError(
            f"layer_types has {', '.join(unknown)}: a DFlash drafter layer is {FULL!r} or {SLIDING!r} "
            "(SGLang refuses any other kind, vLLM would run it as full attention)"
        )


def check_runnable(config: Mapping[str, Any]) -> None:
    """Refuse the keys that change a layer's attention in vLLM in ways the offline forward does not compute."""
    dflash = _dflash(config)
    key = "dflash_config.attention_sink_bias" if "attention_sink_bias" in dflash else "add_swa_attention_sink_bias"
    if dflash.get("attention_sink_bias", config.get("add_swa_attention_sink_bias", False)):
        raise LayoutError(
            f"{key} is true: attention sinks (qwen3_dflash.py:349-353) are not computed offline; "
            "evaluate a drafter without them"
        )
    if dflash.get("attention_value_scale") is not None:
        raise LayoutError(
            f"dflash_config.attention_value_scale is {dflash['attention_value_scale']!r}: vLLM scales the values by it "
            "(qwen3_dflash.py:324-325, 374), the offline forward does not; remove it or evaluate another drafter"
        )
    if config.get("is_neox_style", True) is not True:
        raise LayoutError(
            f"is_neox_style is {config['is_neox_style']!r}: the offline forward rotates neox-style only "
            "(qwen3_dflash.py:359-364); remove the key or evaluate another drafter"
        )


def difference(ours: list[LayerLayout], theirs: list[LayerLayout], name: str) -> str | None:
    """Where `theirs` (engine `name`) differs from `ours` in causality or window, None when they agree."""
    differ = [
        f"layer {i}: {name} causal={t.causal} window={t.sliding_window}, ours causal={o.causal} "
        f"window={o.sliding_window} (decided by {o.causal_from}, {o.window_from or o.sliding_from})"
        for i, (o, t) in enumerate(zip(ours, theirs))
        if (o.causal, o.sliding_window) != (t.causal, t.sliding_window)
    ]
    return "; ".join(differ[:4]) if differ else None


def metrics_section(layers: list[LayerLayout]) -> dict[str, Any]:
    """metrics.json's `attention_layout`: the rule and each layer's layout with the keys that decided it."""
    return {"rule": VLLM_RULE, "layers": [layer.as_dict() for layer in layers]}
