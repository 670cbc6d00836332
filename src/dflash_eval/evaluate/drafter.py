"""Strict loading of DFlash drafter checkpoints, whatever layout they come in.

The second seed write-up is the reason this module is strict: a checkpoint whose `fc.weight` did
not match was "skipped" on load and evaluated with random weights. Here every missing, unexpected
or mis-shaped key is an error that lists them, and the layer count implied by `fc.weight` must
equal the drafter's `target_layer_ids`.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash_eval.errors import DflashEvalError

log = logging.getLogger(__name__)

PREFIXES = ("module.", "model.", "_orig_mod.")
STATE_KEYS = ("model_state_dict", "state_dict", "model")


@dataclass
class LoadedDrafter:
    """A drafter ready to run, with the facts the evaluation records about it."""

    model: torch.nn.Module
    config: Qwen3Config
    layer_ids: list[int]
    block_size: int
    mask_token_id: int
    layout: str
    path: str
    global_step: int | None = None
    epoch: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _read_config(source: str | Path) -> dict:
    source = Path(source)
    config_file = source / "config.json" if source.is_dir() else source
    if not config_file.exists():
        raise DflashEvalError(f"drafter config {config_file} not found; give `config:` as a config.json or HF directory")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise DflashEvalError(f"{config_file}: not valid JSON ({error})") from error


def detect_layout(path: Path) -> str:
    """hf (directory with config.json), safetensors (bare file) or pt (training checkpoint)."""
    if path.is_dir():
        return "hf"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in {".pt", ".pth", ".bin", ".ckpt"}:
        return "pt"
    raise DflashEvalError(
        f"{path}: cannot tell the checkpoint layout; use a HF directory, a .safetensors file or a .pt/.pth "
        "training checkpoint, or set `layout:` for this drafter"
    )


def _strip_prefixes(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes (DDP `module.`, `model.`, torch.compile `_orig_mod.`) only when needed."""
    changed = True
    while changed and state and not set(state) & expected:
        changed = False
        for prefix in PREFIXES:
            if all(key.startswith(prefix) for key in state):
                state = {key[len(prefix):]: value for key, value in state.items()}
                changed = True
                break
    return state


def _read_pt(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if allow_pickle:
        warnings.warn(f"{path}: loading with weights_only=False runs pickled code from the file (allow_pickle: true)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as error:  # torch raises UnpicklingError and others
        raise DflashEvalError(
            f"{path}: could not be loaded with weights_only={not allow_pickle} ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}). If you trust the file, set `allow_pickle: true` for this drafter."
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


def _read_state(path: Path, layout: str, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if layout == "hf":
        single = path / "model.safetensors"
        index = path / "model.safetensors.index.json"
        if single.exists():
            return load_file(str(single)), {}
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for file in files:
                state.update(load_file(str(path / file)))
            return state, {}
        raise DflashEvalError(f"{path}: HF drafter directory has no model.safetensors (or index)")
    if layout == "safetensors":
        return load_file(str(path)), {}
    return _read_pt(path, allow_pickle)


def _check_keys(path: Path, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(
        f"{key}: checkpoint {tuple(state[key].shape)} vs model {tuple(expected[key].shape)}"
        for key in set(state) & set(expected)
        if state[key].shape != expected[key].shape
    )
    if missing or unexpected or mis_shaped:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected))
        if mis_shaped:
            parts.append("mis-shaped: " + "; ".join(mis_shaped))
        raise DflashEvalError(
            f"{path}: checkpoint does not match the drafter config ({' | '.join(parts)}). Nothing is skipped: "
            "fix the config (layer ids, hidden size, layer count) or the checkpoint."
        )


def _check_layer_count(path: Path, state: dict[str, torch.Tensor], hidden: int, layer_ids: list[int]) -> None:
    fc = state.get("fc.weight")
    if fc is None:
        return  # reported as a missing key by _check_keys
    if fc.shape[1] % hidden:
        raise DflashEvalError(f"{path}: fc.weight {tuple(fc.shape)} in-features are not a multiple of hidden_size {hidden}")
    n_layers = fc.shape[1] // hidden
    if n_layers != len(layer_ids):
        raise DflashEvalError(
            f"{path}: fc.weight {tuple(fc.shape)} takes {n_layers} target layers but target_layer_ids "
            f"{layer_ids} has {len(layer_ids)}. Set `layer_ids:` for this drafter (or dflash_config.target_layer_ids "
            f"in its config.json) to the {n_layers} layers it was trained with."
        )


def _build(model_class: type, config: Qwen3Config, path: Path) -> torch.nn.Module:
    """The drafter module; a DFlash2 config without its extra settings is an error naming them."""
    try:
        return model_class(config)
    except (TypeError, ValueError, KeyError) as error:  # _draft_value(...) gave None for a needed setting
        hint = ("; a DFlash2DraftModel needs conv_kernel_size, conv_group_size, selector_rank and selector_top_k "
                "in dflash_config" if "DFlash2" in model_class.__name__ else "; check its config.json")
        raise DflashEvalError(
            f"{path}: cannot build {model_class.__name__} from its config ({type(error).__name__}: {error}){hint}"
        ) from error


def _codebook_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DFlash2 checkpoints store the selector's codebooks without `.weight` (its from_pretrained maps them)."""
    bare = {f"candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook")}
    return {f"{key}.weight" if key in bare else key: value for key, value in state.items()}


def drafter_layer_ids(config: dict) -> list[int] | None:
    """target_layer_ids from a drafter config.json dict, where the reference package reads them."""
    ids = config.get("dflash_config", {}).get("target_layer_ids", config.get("target_layer_ids"))
    return None if ids is None else [int(i) for i in ids]


def load_drafter(
    path: str | Path,
    layout: str = "auto",
    config: str | Path | None = None,
    layer_ids: list[int] | None = None,
    allow_pickle: bool = False,
    vocab_size: int | None = None,
) -> LoadedDrafter:
    """Load a drafter strictly; `layer_ids` (from config.yaml) must agree with the checkpoint's own."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    path = Path(path)
    if not path.exists():
        raise DflashEvalError(f"drafter checkpoint {path} does not exist")
    layout = detect_layout(path) if layout == "auto" else layout
    config_source = config if config is not None else (path if layout == "hf" else None)
    if config_source is None:
        sibling = path.parent / "config.json"
        if not sibling.exists():
            raise DflashEvalError(f"{path}: a {layout} checkpoint needs `config:` (a drafter config.json or HF dir)")
        config_source = sibling
    config_dict = _read_config(config_source)
    model_class = DFlash2DraftModel if "DFlash2DraftModel" in config_dict.get("architectures", []) else DFlashDraftModel
    own_ids = drafter_layer_ids(config_dict)
    if own_ids is not None and layer_ids is not None and list(layer_ids) != own_ids:
        raise DflashEvalError(
            f"{path}: config.yaml says layer_ids {list(layer_ids)} but the drafter config says "
            f"target_layer_ids {own_ids}; make them equal (the checkpoint's own list is the truth)"
        )
    ids = own_ids if own_ids is not None else layer_ids
    if ids is None:
        raise DflashEvalError(f"{path}: no target_layer_ids in the drafter config; set `layer_ids:` in config.yaml")
    config_dict.setdefault("dflash_config", {})["target_layer_ids"] = list(ids)
    qwen_config = Qwen3Config.from_dict({k: v for k, v in config_dict.items() if k not in {"auto_map"}})
    mask_token_id = qwen_config.dflash_config.get("mask_token_id", getattr(qwen_config, "mask_token_id", None))
    if mask_token_id is None:
        raise DflashEvalError(f"{path}: no dflash_config.mask_token_id in the drafter config")
    if vocab_size is not None and not 0 <= int(mask_token_id) < vocab_size:
        raise DflashEvalError(f"{path}: mask_token_id {mask_token_id} is outside the target vocabulary (size {vocab_size})")
    state, meta = _read_state(path, layout, allow_pickle)
    with torch.device("meta"):
        skeleton = _build(model_class, qwen_config, path)
    state = _codebook_keys(_strip_prefixes(state, set(skeleton.state_dict())))
    _check_layer_count(path, state, qwen_config.hidden_size, list(ids))
    _check_keys(path, skeleton, state)
    model = _build(model_class, qwen_config, path)
    model.load_state_dict(state, strict=True)
    model.eval()
    step = meta.get("global_step", meta.get("step"))
    return LoadedDrafter(
        model=model, config=qwen_config, layer_ids=list(ids), block_size=int(model.block_size),
        mask_token_id=int(mask_token_id), layout=layout, path=str(path),
        global_step=None if step is None else int(step),
        epoch=None if meta.get("epoch") is None else float(meta["epoch"]),
    )
