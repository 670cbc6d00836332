"""A DFlash checkpoint's attention layout, per layer, as vLLM 0.34.0 resolves it and as the reference package does.

vLLM (model_executor/models/qwen3_dflash.py, _dflash_layer_causal and the layer's sliding-window resolution):
causal = `is_causal` when set, else `dflash_config.causal`, else `layer_types[i] == "sliding_attention"`, else
False; sliding = `layer_types[i]` sliding, or every layer when `dflash_config.use_swa` and no `layer_types` entry is
sliding (or there are none); window = `dflash_config.swa_window_size`, else `sliding_window`. dflash 0.1.0
(`model.py`, the attention layer) knows neither `dflash_config.causal` nor `use_swa` nor `swa_window_size`: causal =
`is_causal` when set, else sliding; window = `sliding_window` on the sliding layers. Where the two differ, the
offline drafter (evaluated by dflash's rule) is not the drafter vLLM serves, and the online panel must say so.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"


def vllm_layout(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer {"causal", "sliding_window"} as vLLM 0.34.0 resolves them (ValueError: a sliding layer, no window)."""
    dflash = config.get("dflash_config") or {}
    layer_types = config.get("layer_types")
    use_swa = bool(dflash.get("use_swa", False))
    any_sliding = bool(layer_types) and SLIDING in layer_types
    out = []
    for i in range(int(config["num_hidden_layers"])):
        if config.get("is_causal") is not None:
            causal = bool(config["is_causal"])
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = bool(layer_types) and layer_types[i] == SLIDING
        sliding = use_swa if layer_types is None or (use_swa and not any_sliding) else layer_types[i] == SLIDING
        window = None
        if sliding:
            window = dflash.get("swa_window_size", config.get("sliding_window"))
            if window is None:
                raise ValueError(
                    f"layer {i} is sliding but neither dflash_config.swa_window_size nor sliding_window "
                    "is set (vLLM refuses the checkpoint)"
                )
        out.append({"causal": causal, "sliding_window": None if window is None else int(window)})
    return out


def reference_layout(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer {"causal", "sliding_window"} as dflash 0.1.0's attention layer resolves them."""
    layer_types = config.get("layer_types")
    out = []
    for i in range(int(config["num_hidden_layers"])):
        sliding = bool(layer_types) and layer_types[i] == SLIDING
        causal = sliding if config.get("is_causal") is None else bool(config["is_causal"])
        window = config.get("sliding_window") if sliding else None
        out.append({"causal": causal, "sliding_window": None if window is None else int(window)})
    return out


def layout_difference(config: dict[str, Any]) -> str | None:
    """How vLLM's layout of this checkpoint differs from the reference's, None when they agree."""
    served, ours = vllm_layout(config), reference_layout(config)
    differ = [f"layer {i}: vLLM {s}, dflash {o}" for i, (s, o) in enumerate(zip(served, ours)) if s != o]
    if not differ:
        return None
    return (
        "vLLM resolves this checkpoint's attention layout otherwise than the offline drafter (dflash's rule: "
        f"no dflash_config.causal, use_swa or swa_window_size): {'; '.join(differ[:4])}"
    )
