"""Strict loading of DFlash drafter checkpoints, whatever layout they come in.

The second seed write-up is the reason this module is strict: a checkpoint whose `fc.weight` did
not match was "skipped" on load and evaluated with random weights. Here every missing, unexpected
or mis-shaped key is an error that lists them, and the layer count implied by `fc.weight` must
equal the drafter's `target_layer_ids`.

The weights go into evaluate.drafter_model's module tree (torch alone: the evaluation's start-up no longer imports
transformers' modeling or `dflash`); `reference=True` loads them into `dflash.model`'s own classes instead, for a caller
that runs the reference forward (`dflash_generate`: the demo server). Either way each layer runs the attention layout
vLLM resolves from the config (dflash_eval.attention_layout); one it cannot run is refused here, naming the key.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_eval.attention_layout import LayerLayout, LayoutError
from dflash_eval.checkpoint import (
    agreed_layer_ids,
    check_against_target,
    check_fc_width,
    checkpoint_facts,
    strip_prefixes,
)
from dflash_eval.checkpoint_weights import read_state
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import drafter_model
from dflash_eval.evaluate.drafter_model import DrafterConfig

log = logging.getLogger(__name__)


@dataclass
class LoadedDrafter:
    """A drafter ready to run, with the facts the evaluation records about it."""

    model: torch.nn.Module
    config: Any  # a DrafterConfig (transformers' Qwen3Config with reference=True)
    layer_ids: list[int]
    block_size: int
    mask_token_id: int
    layout: str
    path: str
    global_step: int | None = None
    epoch: float | None = None
    attention_layout: list[LayerLayout] = field(default_factory=list)  # what each layer runs (vLLM's resolution)
    extra: dict[str, Any] = field(default_factory=dict)


def _strip_prefixes(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes (DDP `module.`, `model.`, torch.compile `_orig_mod.`) only when needed."""
    return {key: state[name] for name, key in strip_prefixes(list(state), expected).items()}


def check_finite(path: Path, state: dict[str, torch.Tensor], fix: str) -> None:
    """Every floating weight finite, else an error naming each bad tensor and `fix`.

    One NaN in a drafter's fc.weight made every draft token wrong, with exit 0 and tau 1.000.
    """
    bad = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            bad.append(f"{name} ({nan} NaN, {inf} Inf of {tensor.numel()} values)")
    if bad:
        raise DflashEvalError(f"{path}: non-finite weights in {', '.join(bad)}; {fix}")


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


def _build(model_class: type, config: Any, path: Path) -> torch.nn.Module:
    """The drafter module; a DFlash2 config without its extra settings is an error naming them."""
    try:
        return model_class(config)
    except (TypeError, ValueError, KeyError) as error:  # _draft_value(...) gave None for a needed setting
        hint = (
            "; a DFlash2DraftModel needs conv_kernel_size, conv_group_size, selector_rank and selector_top_k "
            "in dflash_config"
            if "DFlash2" in model_class.__name__
            else "; check its config.json"
        )
        raise DflashEvalError(
            f"{path}: cannot build {model_class.__name__} from its config ({type(error).__name__}: {error}){hint}"
        ) from error


def _codebook_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DFlash2 checkpoints store the selector's codebooks without `.weight` (its from_pretrained maps them)."""
    bare = {f"candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook")}
    return {f"{key}.weight" if key in bare else key: value for key, value in state.items()}


def load_drafter(
    path: str | Path,
    layout: str = "auto",
    config: str | Path | None = None,
    layer_ids: list[int] | None = None,
    allow_pickle: bool = False,
    vocab_size: int | None = None,
    reference: bool = False,
) -> LoadedDrafter:
    """Load a drafter strictly; `layer_ids` (from config.yaml) must agree with the checkpoint's own.

    `reference`: into `dflash.model`'s DFlashDraftModel / DFlash2DraftModel (transformers' Qwen3Config), for a caller
    that runs their forward; by default into evaluate.drafter_model's classes of the same names and parameters.
    """
    facts = checkpoint_facts(path, layout, config)  # layout, config.json and headers, as the workflow read them
    path, layout, config_dict = facts.path, facts.layout, dict(facts.config)
    model_class = drafter_model.model_class(config_dict)
    ids = agreed_layer_ids(facts, layer_ids)
    config_dict.setdefault("dflash_config", {})["target_layer_ids"] = list(ids)
    attention = _attention_layout(facts.config_file, DrafterConfig(config_dict))
    if reference:
        import dflash.model  # the reference classes and transformers: seconds of imports, only for their forward

        model_class = getattr(dflash.model, model_class.__name__)
        qwen_config = DrafterConfig(config_dict).reference_config()
    else:
        qwen_config = DrafterConfig(config_dict)
    mask_token_id = qwen_config.dflash_config.get("mask_token_id", getattr(qwen_config, "mask_token_id", None))
    if mask_token_id is None:
        raise DflashEvalError(f"{path}: no dflash_config.mask_token_id in the drafter config")
    check_against_target(path, None, mask_token_id, None, vocab_size)
    state, meta = read_state(path, layout, allow_pickle)
    check_finite(
        path, state, "the checkpoint is broken (a diverged training step, or a damaged file): evaluate another one"
    )
    with torch.device("meta"):
        skeleton = _build(model_class, qwen_config, path)
    state = _codebook_keys(_strip_prefixes(state, set(skeleton.state_dict())))
    if "fc.weight" in state:  # else reported as a missing key by _check_keys
        check_fc_width(path, tuple(state["fc.weight"].shape), qwen_config.hidden_size, list(ids))
    _check_keys(path, skeleton, state)
    # Ours: the skeleton's storage, uninitialised (every weight is loaded now). The reference's: built again (its
    # post_init initialises every weight first).
    model = _build(model_class, qwen_config, path) if reference else drafter_model.materialize(skeleton)
    model.load_state_dict(state, strict=True)
    model.eval()
    apply_layout(model, attention)  # the reference classes resolve dflash's way: make them run vLLM's layout too
    step = meta.get("global_step", meta.get("step"))
    return LoadedDrafter(
        model=model,
        config=qwen_config,
        layer_ids=list(ids),
        block_size=int(model.block_size),
        mask_token_id=int(mask_token_id),
        layout=layout,
        path=str(path),
        global_step=None if step is None else int(step),
        epoch=None if meta.get("epoch") is None else float(meta["epoch"]),
        attention_layout=attention,
    )


def _attention_layout(config_file: Path, config: DrafterConfig) -> list[LayerLayout]:
    """Each layer's layout as vLLM resolves it, or an error naming the config file, the key and the fix."""
    try:
        return config.layer_layouts()
    except LayoutError as error:
        raise DflashEvalError(f"{config_file}: the drafter's attention layout cannot be evaluated: {error}") from error


def apply_layout(model: torch.nn.Module, layout: list[LayerLayout]) -> None:
    """Set each layer's causality and window (the attributes both forwards read) to `layout`'s."""
    for layer, resolved in zip(model.layers, layout, strict=True):
        layer.self_attn.is_causal, layer.self_attn.sliding_window = resolved.causal, resolved.sliding_window


_REFERENCES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]] = weakref.WeakKeyDictionary()


def reference_drafter(model: torch.nn.Module) -> torch.nn.Module:
    """`dflash.model`'s DFlashDraftModel / DFlash2DraftModel holding `model`'s weights (device and dtype included),
    for its own forward (`dflash_generate`); a reference model is returned as it is.

    Kept while `model`'s weights stay the same tensors unchanged (a moved or trained model gets a new one).
    """
    if not isinstance(model, drafter_model.DFlashDraftModel):
        return model
    import dflash.model

    params = list(model.state_dict().values())
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in params)
    cached = _REFERENCES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    first = params[0]
    with torch.device(first.device):
        reference = getattr(dflash.model, type(model).__name__)(model.config.reference_config())
    reference.load_state_dict(model.state_dict(), strict=True)
    apply_layout(reference, model.config.layer_layouts())
    reference = reference.to(dtype=first.dtype).train(model.training)
    _REFERENCES[model] = (key, reference)
    return reference
