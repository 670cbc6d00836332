"""T_draft: one drafter step (block forward with the LM head, batch 1) timed on the evaluation device.

How, in detail: docs/internals.md (`evaluate/draft_timing.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.speedup.forwards.drafter import StaticDrafter
from dflash_eval.speedup.forwards.graphs import capture
from dflash_eval.speedup.forwards.tree_step import draft_top, fill_tree, host_buffer, tree_buffer
from dflash_eval.speedup.timing import timed_ms, wanted

METHODS = ("graphs", "static", "eager")
log = logging.getLogger(__name__)


def static_unsupported(runner: BlockDrafter) -> str | None:
    """Why the static drafter cannot run this drafter's step (None when it can): it runs DFlashDraftModel's
    layers; DFlash2's block convolutions and candidate selector are the evaluator's alone."""
    drafter = runner.drafter
    if getattr(drafter, "mask_token_id", None) != runner.mask_token_id:
        return (
            f"the drafter's config names mask token {getattr(drafter, 'mask_token_id', None)!r} and evaluation "
            f"uses {runner.mask_token_id}: the static drafter reads the config's"
        )
    if getattr(drafter, "candidate_selector", None) is not None or any(
        getattr(layer, name, None) is not None for layer in drafter.layers for name in ("attention_conv", "mlp_conv")
    ):
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
def drafter_step_ms(
    runner: BlockDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    context_tokens: int,
    repeats: int,
    block_size: int | None = None,
    project_tokens: int = 1,
    method: str = "eager",
    method_why: str = "asked",
    budget: int | None = None,
) -> dict[str, Any]:
    """Median ms (and spread) of one drafter step at anchor min(context_tokens, T - 1): the projection of
    `project_tokens` new context rows, then a block of `block_size` (the drafter's own by default) + LM head;
    with a `budget`, a DDTree's step (its block the drafter's own): the tree's top-k, read, build and upload."""
    block = runner.block_size if block_size is None else int(block_size)
    if budget is not None and block != runner.block_size:
        raise ValueError(f"a DDTree step drafts the drafter's own block ({runner.block_size}), not {block}")
    if not 2 <= block <= runner.block_size:
        raise ValueError(f"a drafter step of block {block}: the drafter drafts blocks of 2..{runner.block_size}")
    if method not in METHODS:
        raise ValueError(f"drafter timing method {method!r}: one of {', '.join(METHODS)}")
    anchor = max(0, min(int(context_tokens), tokens.shape[0] - 1))
    project = max(1, min(int(project_tokens), anchor + 1))
    tree = None if budget is None else TreeWork(int(budget), block - 1, runner.lm_head.shape[0], tokens.device)
    if method == "eager":
        step = _eager_step(runner, features, tokens, anchor, block, project, tree)
    else:
        step = static_step(runner, features, tokens, anchor, block, project, graphs=method == "graphs", tree=tree)[0]
    timing = timed_ms(step if tree is None else tree.after(step), tokens.device, repeats, budget_s=2.0)
    return {
        **timing,
        "context_tokens": anchor,
        "block_size": block,
        "project_tokens": project,
        "device": str(tokens.device),
        "method": method,
        "method_why": method_why,
        **({} if budget is None else {"budget": int(budget)}),
    }


class TreeWork:
    """A DDTree step's work beyond the drafter's forward, on the tree loop's own code (speedup/live_loops/tree.py):
    `on_device(logits)` the top-k into a static buffer (inside the drafter's graph where it is one); `on_host()`
    its one read, the tree's build and its upload."""

    def __init__(self, budget: int, positions: int, vocab: int, device: torch.device) -> None:
        self.budget = budget
        self.top = torch.zeros(2, positions, min(budget, vocab), device=device, dtype=torch.float64)
        self.top_host = host_buffer(self.top)
        self.tree = tree_buffer(budget, device)
        self.tree_host = host_buffer(self.tree)

    def on_device(self, logits: torch.Tensor) -> None:
        draft_top(logits, self.top)

    def on_host(self) -> None:
        fill_tree(self.top_host.copy_(self.top).numpy(), self.budget, self.tree_host)
        self.tree.copy_(self.tree_host, non_blocking=True)

    def after(self, step: Callable[[], None]) -> Callable[[], None]:
        """`step` (which ends in on_device) and then the host's share: the whole DDTree drafting step."""

        def both() -> None:
            step()
            self.on_host()

        return both


def _eager_step(
    runner: BlockDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    anchor: int,
    block: int,
    project: int,
    tree: TreeWork | None = None,
) -> Callable[[], None]:
    context = runner.context(features[: anchor + 1])
    anchors = torch.tensor([anchor], device=tokens.device)

    def step() -> None:
        runner.context(features[anchor + 1 - project : anchor + 1])  # the per-step projection (its cost only)
        logits = runner.logits(runner.block_hidden(context, tokens[: anchor + 1], anchors, block, ctx_len=anchor))
        if tree is None:
            logits.argmax(-1)
        else:
            tree.on_device(logits[0])

    return step


def static_step(
    runner: BlockDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    anchor: int,
    block: int,
    project: int,
    graphs: bool,
    tree: TreeWork | None = None,
) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """The same step on the static drafter (as the validated loop runs it): context rows before the last
    `project` ones written once; per call, those `project` rows projected into the buffer and the block
    [token at the anchor, masks] drafted at the anchor's position (with a `tree`, its logits' top-k taken in the
    same step). (step, drafts): the step (a graph's replay where `graphs` and CUDA) and a reader of the b - 1
    drafts its last call wrote."""
    device = tokens.device
    first = anchor + 1 - project  # the first row the step projects (rows anchor+1-project .. anchor)
    with torch.inference_mode():  # as the validated loop builds it (live_loops.chain.StaticLoop)
        static = StaticDrafter(runner.drafter, runner.embed, runner.head_logits, anchor + block)
        if first > 0:
            static.context(features[:first], torch.zeros(1, dtype=torch.long, device=device))
        rows = features[first : anchor + 1].clone()
        ctx_start = torch.full((1,), first, dtype=torch.long, device=device)
        start = torch.full((1,), anchor, dtype=torch.long, device=device)
        bonus = tokens[anchor : anchor + 1].clone()
        drafts = torch.zeros(block - 1, dtype=torch.long, device=device)

    def step() -> None:
        logits = static.draft_logits(rows, ctx_start, bonus, start, block)
        drafts.copy_(logits.argmax(-1))
        if tree is not None:
            tree.on_device(logits)

    return _Holding(capture(step, device, graphs), step), lambda: drafts.clone()


class _Holding:
    """A step that holds what it runs on. A CUDA graph reads and writes the memory of the drafter and buffers
    `step` closes over without holding them: freed once `step` is, their memory is reused, and a replay
    gathers from garbage (CUDA's device-side index assert)."""

    def __init__(self, run: Callable[[], None], step: Callable[[], None]) -> None:
        self.run, self.step = run, step

    def __call__(self) -> None:
        self.run()


def time_on_cache(
    runner: BlockDrafter,
    cache,
    layer_ids: list[int],
    device: torch.device,
    dtype: torch.dtype,
    options: dict[str, Any],
    projections: dict[int, int],
    target_method: str | None = None,
    trees: dict[int, int] | None = None,
) -> dict[str, Any] | None:
    """drafter_step_ms at each block size (-> the context rows its step projects) and at each DDTree budget
    (`trees`: budget -> rows; the drafter's own block), on the cache's longest sample (the closest to a typical
    serving context), timed as `timing_method` chooses from the target profile's `target_method`:
    {"by_block": {b: timing}, "by_budget": {N: timing}, "device", "context_tokens", "method", "method_why"}."""
    if not cache.samples or not wanted(options, device):
        return None
    longest = max(cache.samples, key=lambda sample: int(sample["length"]))
    states = cache.load_sample(str(longest["id"]), layer_ids)
    features, tokens = states.features.to(device=device, dtype=dtype), states.input_ids.to(device)
    method, why = timing_method(runner, device, target_method)
    blocks = {int(block): rows for block, rows in projections.items() if 2 <= int(block) <= runner.block_size}
    budgets = {int(budget): rows for budget, rows in (trees or {}).items()}
    if not blocks and not budgets:
        return None
    context, repeats = int(options["context_tokens"]), int(options["repeats"])

    def steps(method: str, why: str) -> tuple[dict[int, dict], dict[int, dict]]:
        return (
            {
                block: drafter_step_ms(runner, features, tokens, context, repeats, block, rows, method, why)
                for block, rows in blocks.items()
            },
            {
                budget: drafter_step_ms(
                    runner, features, tokens, context, repeats, None, rows, method, why, budget=budget
                )
                for budget, rows in budgets.items()
            },
        )

    try:
        by_block, by_budget = steps(method, why)
    except RuntimeError as error:  # a capture CUDA refuses: time it as the evaluator runs, never fail the job
        if method == "eager":
            raise
        log.warning("drafter step: CUDA graph timing failed (%s); timed eagerly instead", error)
        method, why = "eager", f"CUDA graph timing failed: {error}"
        by_block, by_budget = steps(method, why)
    first = next(iter({**by_block, **by_budget}.values()))
    return {
        "by_block": by_block,
        "by_budget": by_budget,
        "device": first["device"],
        "context_tokens": first["context_tokens"],
        "method": method,
        "method_why": why,
    }
