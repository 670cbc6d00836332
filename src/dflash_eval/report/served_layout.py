"""Whether the engine that serves a DFlash checkpoint runs the attention layout the offline drafter ran.

The evaluation runs each layer as vLLM 0.34.0 resolves the checkpoint's config.json (dflash_eval.attention_layout,
recorded in metrics.json's `attention_layout`), so a vLLM server runs what was evaluated. SGLang 0.5.23 reads fewer
keys (no `dflash_config.causal`, `use_swa` or `swa_window_size`): where that changes a layer, the SGLang-served drafter
is not the evaluated one, and the online panel must say so.
"""

from __future__ import annotations

from typing import Any

from dflash_eval import attention_layout

ENGINES = {"vllm": attention_layout.vllm_layout, "sglang": attention_layout.sglang_layout}


def layout_difference(config: dict[str, Any], engine: str = "vllm") -> str | None:
    """How `engine` lays out this config.json's layers otherwise than the offline drafter, None when they agree.

    ValueError (attention_layout.LayoutError): a layout the engine or the evaluation refuses, with the key."""
    values = attention_layout.completed(config)
    ours = attention_layout.vllm_layout(values)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: the served layout is known for {', '.join(sorted(ENGINES))}")
    differ = attention_layout.difference(ours, ENGINES[engine](values), engine)
    if differ is None:
        return None
    return (
        f"{engine} resolves this checkpoint's attention layout otherwise than the offline drafter (vLLM's rule: "
        f"{engine} reads no dflash_config.causal, use_swa or swa_window_size): {differ}"
    )
