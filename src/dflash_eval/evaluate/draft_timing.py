"""T_draft: one drafter step (block forward with the LM head, batch 1) timed on the evaluation device.

The step is what the live loop's drafter does per verification step: project the target states of
the tokens the last step accepted into its KV cache (fc, hidden_norm, each layer's k/v: the per-step
context projection), then the evaluator's own block forward for one anchor at a block size b, its
LM head over b - 1 positions and their argmax. The older context is already projected (what a
serving drafter's KV cache holds); the anchor is at the profile's context length or the longest
cached sample's, whichever is shorter. Timed only when the profile does not give it.

How (`method`, as the target profile's): `graphs` on CUDA, the validated loop's static drafter
(speedup/static_models.py: a preallocated KV buffer, the step captured as one CUDA graph and replayed), so that
T_draft is timed the way a server runs it and the way the profile times T_AR; `eager` the evaluator's own
forward (the target profile was timed eagerly, or a drafter the static path does not run); `static` the graphs'
code path run eagerly (a CPU, tests). The H200 records showed why it matters: an eager T_draft (6.5-11.9 ms)
beside a graph-timed T_AR put the estimate 1.9-2.7x below the measured speedup, where the loop's graph
T_draft (2.0 ms) put it within 2% (benchmarks/results/speedup_validation.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.speedup.static_loop import capture
from dflash_eval.speedup.static_models import StaticDrafter
from dflash_eval.speedup.timing import timed_ms, wanted

METHODS = ("graphs", "static", "eager")
log = logging.getLogger(__name__)


def static_unsupported(runner: BlockDrafter) -> str | None:
    """Why the static drafter cannot run this drafter's step (None when it can): it runs DFlashDraftModel's
    layers; DFlash2's block convolutions and candidate selector are the evaluator's alone."""
    drafter = runner.drafter
    if getattr(drafter, "mask_token_id", None) != runner.mask_token_id:
        return (f"the drafter's config names mask token {getattr(drafter, 'mask_token_id', None)!r} and evaluation "
                f"uses {runner.mask_token_id}: the static drafter reads the config's")
    if getattr(drafter, "candidate_selector", None) is not None or any(
            getattr(layer, name, None) is not None for layer in drafter.layers
            for name in ("attention_conv", "mlp_conv")):
        return "a DFlash2 drafter (block convolutions, candidate selector): the static drafter runs DFlash's layers"
    return None


def timing_method(runner: BlockDrafter, device: torch.device, target_method: str | None) -> tuple[str, str]:
    """(method, why): graphs on CUDA unless the target profile was timed eagerly (then eager too: one way for
    both terms of the estimate) or the drafter is one the static path does not run."""
    if device.type != "cuda":
        return "eager", "no CUDA graphs on this device"
    if target_method == "eager":
        return "eager", "the target profile was timed eagerly (HF forward): the drafter step is timed the same way"
    why = static_unsupported(runner)
    return ("eager", why) if why else ("graphs", "a static drafter KV buffer, the step captured as one CUDA graph")


@torch.inference_mode()
def drafter_step_ms(runner: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, context_tokens: int,
                    repeats: int, block_size: int | None = None, project_tokens: int = 1,
                    method: str = "eager", method_why: str = "asked") -> dict[str, Any]:
    """Median ms (and spread) of one drafter step at anchor min(context_tokens, T - 1): the projection of
    `project_tokens` new context rows, then a block of `block_size` (the drafter's own by default) + LM head."""
    block = runner.block_size if block_size is None else int(block_size)
    if not 2 <= block <= runner.block_size:
        raise ValueError(f"a drafter step of block {block}: the drafter drafts blocks of 2..{runner.block_size}")
    if method not in METHODS:
        raise ValueError(f"drafter timing method {method!r}: one of {', '.join(METHODS)}")
    anchor = max(0, min(int(context_tokens), tokens.shape[0] - 1))
    project = max(1, min(int(project_tokens), anchor + 1))
    if method == "eager":
        step = _eager_step(runner, features, tokens, anchor, block, project)
    else:
        step = static_step(runner, features, tokens, anchor, block, project, graphs=method == "graphs")[0]
    timing = timed_ms(step, tokens.device, repeats, budget_s=2.0)
    return {**timing, "context_tokens": anchor, "block_size": block, "project_tokens": project,
            "device": str(tokens.device), "method": method, "method_why": method_why}


def _eager_step(runner: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, anchor: int, block: int,
                project: int) -> Callable[[], None]:
    context = runner.context(features[:anchor + 1])
    anchors = torch.tensor([anchor], device=tokens.device)

    def step() -> None:
        runner.context(features[anchor + 1 - project:anchor + 1])  # the per-step projection (its cost only)
        runner.logits(runner.block_hidden(context, tokens[:anchor + 1], anchors, block, ctx_len=anchor)).argmax(-1)

    return step


class _LinearHead(torch.nn.Module):
    """The LM head as the evaluator applies it (a plain product: dflash's compute_logits adds the multiplier and
    softcap, as BlockDrafter.head_logits does)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


def static_step(runner: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, anchor: int, block: int,
                project: int, graphs: bool) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """The same step on the static drafter (as the validated loop runs it): context rows before the last
    `project` ones written once; per call, those `project` rows projected into the buffer and the block
    [token at the anchor, masks] drafted at the anchor's position. (step, drafts): the step (a graph's replay
    where `graphs` and CUDA) and a reader of the b - 1 drafts its last call wrote."""
    device = tokens.device
    first = anchor + 1 - project  # the first row the step projects (rows anchor+1-project .. anchor)
    with torch.inference_mode():  # as the validated loop builds it (static_loop.StaticLoop)
        static = StaticDrafter(runner.drafter, runner.embed, _LinearHead(runner.lm_head), anchor + block)
        if first > 0:
            static.context(features[:first], torch.zeros(1, dtype=torch.long, device=device))
        rows = features[first:anchor + 1].clone()
        ctx_start = torch.full((1,), first, dtype=torch.long, device=device)
        start = torch.full((1,), anchor, dtype=torch.long, device=device)
        bonus = tokens[anchor:anchor + 1].clone()
        drafts = torch.zeros(block - 1, dtype=torch.long, device=device)

    def step() -> None:
        drafts.copy_(static.draft(rows, ctx_start, bonus, start, block))

    return _Holding(capture(step, device, graphs), step), lambda: drafts.clone()


class _Holding:
    """A step that holds what it runs on. A CUDA graph reads and writes the memory of the drafter and buffers
    `step` closes over without holding them: freed once `step` is, their memory is reused, and a replay
    gathers from garbage (CUDA's device-side index assert)."""

    def __init__(self, run: Callable[[], None], step: Callable[[], None]) -> None:
        self.run, self.step = run, step

    def __call__(self) -> None:
        self.run()


def time_on_cache(runner: BlockDrafter, cache, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
                  options: dict[str, Any], projections: dict[int, int],
                  target_method: str | None = None) -> dict[str, Any] | None:
    """drafter_step_ms at each block size (-> the context rows its step projects), on the cache's longest
    sample (the closest to a typical serving context), timed as `timing_method` chooses from the target
    profile's `target_method`: {"by_block": {b: timing}, "device", "context_tokens", "method", "method_why"}."""
    if not cache.samples or not wanted(options, device):
        return None
    longest = max(cache.samples, key=lambda sample: int(sample["length"]))
    states = cache.load_sample(str(longest["id"]), layer_ids)
    features, tokens = states.features.to(device=device, dtype=dtype), states.input_ids.to(device)
    method, why = timing_method(runner, device, target_method)
    blocks = {int(block): rows for block, rows in projections.items() if 2 <= int(block) <= runner.block_size}
    if not blocks:
        return None
    context, repeats = int(options["context_tokens"]), int(options["repeats"])
    try:
        by_block = {block: drafter_step_ms(runner, features, tokens, context, repeats, block, rows, method, why)
                    for block, rows in blocks.items()}
    except RuntimeError as error:  # a capture CUDA refuses: time it as the evaluator runs, never fail the job
        if method == "eager":
            raise
        log.warning("drafter step: CUDA graph timing failed (%s); timed eagerly instead", error)
        method, why = "eager", f"CUDA graph timing failed: {error}"
        by_block = {block: drafter_step_ms(runner, features, tokens, context, repeats, block, rows, method, why)
                    for block, rows in blocks.items()}
    first = next(iter(by_block.values()))
    return {"by_block": by_block, "device": first["device"], "context_tokens": first["context_tokens"],
            "method": method, "method_why": why}
