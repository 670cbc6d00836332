"""The target's token embedding and LM head, read from its safetensors alone.

The drafter has no embedding or head of its own; it borrows the target's. Loading the whole 27B
target just for two matrices would defeat the point of evaluating from cached states, so we open
the checkpoint's safetensors and read exactly these tensors (CausalLM and VLM key layouts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.drafter import check_finite
from dflash_eval.io_utils import safetensors_header

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


@dataclass
class TargetHead:
    """Embedding [V, H] and LM head [V, H] of the target, plus where they came from."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    tied: bool
    source: dict


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    single = target_dir / "model.safetensors"
    if not single.exists():
        raise DflashEvalError(
            f"{target_dir}: no model.safetensors or model.safetensors.index.json; "
            "the target must be a Hugging Face directory with safetensors weights"
        )
    return {name: single for name in safetensors_header(single, "copy the target again")}


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    """One tensor, refused when it holds NaN/Inf: the drafter's every logit goes through the target's head."""
    try:
        with safe_open(str(files[key]), framework="pt") as handle:
            tensor = handle.get_tensor(key)
    except SafetensorError as error:
        raise DflashEvalError(
            f"{files[key]}: not a readable safetensors file ({error}); copy the target again"
        ) from None
    check_finite(files[key], {key: tensor}, "the target checkpoint is damaged: copy it again")
    return tensor


def load_target_head(target_dir: str | Path) -> TargetHead:
    """Read embed_tokens and lm_head (or the tied embedding) from a target checkpoint directory."""
    target_dir = Path(target_dir)
    config_file = target_dir / "config.json"
    if not config_file.exists():
        raise DflashEvalError(f"{config_file} not found: target.path must be a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    text = _text_config(config)
    files = _weight_files(target_dir)
    embed_key = next((k for k in EMBED_KEYS if k in files), None)
    if embed_key is None:
        raise DflashEvalError(f"{target_dir}: no embedding tensor found (looked for {', '.join(EMBED_KEYS)})")
    head_key = next((k for k in HEAD_KEYS if k in files), None)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if head_key is None and not tied:
        raise DflashEvalError(
            f"{target_dir}: no lm_head tensor (looked for {', '.join(HEAD_KEYS)}) and the config does not "
            "say tie_word_embeddings: true"
        )
    embed = _read(files, embed_key)
    lm_head = embed if head_key is None else _read(files, head_key)
    vocab = text.get("vocab_size")
    if vocab is not None and embed.shape[0] != vocab:
        raise DflashEvalError(f"{target_dir}: {embed_key} has {embed.shape[0]} rows but vocab_size is {vocab}")
    return TargetHead(
        embed=embed,
        lm_head=lm_head,
        tied=head_key is None,
        source={"path": str(target_dir), "embed_key": embed_key, "head_key": head_key},
    )
