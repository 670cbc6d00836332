"""A drafter checkpoint's tensors, read from any layout (HF directory, bare .safetensors, .pt training checkpoint).

Shared ground: the evaluate stage loads a drafter from them, and the report compares the weights a server serves
with a checkpoint's, whatever layout each is saved in.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash_eval.checkpoint import pt_archive_problem, weight_files
from dflash_eval.errors import DflashEvalError

STATE_KEYS = ("model_state_dict", "state_dict", "model")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _load_error_summary(error: Exception) -> str:
    """The line of torch.load's error that says what it refused, without the terminal escapes torch puts in."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    refused = next((line for line in lines if "WeightsUnpickler error" in line), None)
    return refused or (lines[0] if lines else type(error).__name__)


def _read_pt(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if allow_pickle:
        warnings.warn(
            f"{path}: loading with weights_only=False runs pickled code from the file (allow_pickle: true)",
            stacklevel=2,
        )
    problem = pt_archive_problem(path)  # a truncated file is no question of trust
    if problem:
        raise DflashEvalError(f"{path}: {problem}; copy the checkpoint again")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as error:  # torch raises UnpicklingError and others
        raise DflashEvalError(
            f"{path}: could not be loaded with weights_only={not allow_pickle} ({type(error).__name__}: "
            f"{_load_error_summary(error)}). If you trust the file, set `allow_pickle: true` for this drafter."
        ) from error
    meta: dict[str, Any] = {}
    state = checkpoint
    if isinstance(checkpoint, dict):
        for key in STATE_KEYS:
            if key in checkpoint and isinstance(checkpoint[key], dict):
                state = checkpoint[key]
                break
        for key in ("global_step", "step", "epoch"):
            if key in checkpoint and not isinstance(checkpoint[key], dict):
                meta[key] = checkpoint[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DflashEvalError(f"{path}: no state dict found (looked for {', '.join(STATE_KEYS)} or a bare state dict)")
    return state, meta


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except SafetensorError as error:
        raise DflashEvalError(f"{file}: not a readable safetensors file ({error}); copy the checkpoint again") from None


def read_state(path: Path, layout: str, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict (and a .pt's step/epoch) of a checkpoint in `layout`, with errors naming the file."""
    if layout == "pt":
        return _read_pt(path, allow_pickle)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path, layout):
        state.update(_read_safetensors(file))
    return state, {}
