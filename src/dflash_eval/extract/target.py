"""Load the target model's text path (CausalLM or VLM checkpoint) loudly, and fingerprint its config.

A VLM checkpoint (`Qwen3_5ForConditionalGeneration`, keys `model.language_model.*`) loads into the
text-only `Qwen3_5ForCausalLM`: transformers 5.24 maps the `qwen3_5` model type to it for
AutoModelForCausalLM, strips the `language_model` prefix and ignores `model.visual.*` and `mtp.*`.
Any weight that is missing or has the wrong shape is an error: a target with "skipped" weights
silently produces wrong hidden states.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.target_identity import (
    parse_device,
    read_config_json,
    target_config_hash,
    text_config_dict,
)

__all__ = ["load_target", "parse_device", "parse_dtype", "read_config_json", "target_config_hash", "text_config_dict"]

log = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch dtype from a config string such as 'bfloat16'."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise DflashEvalError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def _check_loading(path: str | Path, info: dict[str, Any]) -> None:
    """Fail on missing or mismatched weights; log ignored extras."""
    problems = {key: sorted(map(str, info.get(key) or ())) for key in ("missing_keys", "mismatched_keys", "error_msgs")}
    problems = {key: value for key, value in problems.items() if value}
    if problems:
        detail = "; ".join(f"{key}: {value[:5]}{' ...' if len(value) > 5 else ''}" for key, value in problems.items())
        raise DflashEvalError(f"target {path} did not load cleanly ({detail}); its hidden states would be wrong")
    unexpected = sorted(map(str, info.get("unexpected_keys") or ()))
    if unexpected:
        log.warning("target %s: %d checkpoint tensors unused, e.g. %s", path, len(unexpected), unexpected[:3])


def load_target(
    path: str | Path, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """The target's text model with its LM head, in eval mode on one device, and its text config."""
    from transformers import AutoModelForCausalLM

    read_config_json(path)  # clear error for a wrong path before transformers' own
    device = parse_device(device, "target.device")
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=parse_dtype(dtype),
        device_map={"": str(device)},
        output_loading_info=True,
        trust_remote_code=False,
    )
    _check_loading(path, info)
    inner = getattr(model, "model", None)
    if getattr(inner, "layers", None) is None or model.get_output_embeddings() is None:
        raise DflashEvalError(
            f"target {path} loaded as {type(model).__name__}, which has no model.layers and lm_head; "
            "only decoder-only CausalLM targets (e.g. Qwen3.5 text or VLM checkpoints) are supported"
        )
    model.eval()
    log.info("target %s: %s, %s on %s", path, type(model).__name__, model.dtype, device)
    return model, model.config
