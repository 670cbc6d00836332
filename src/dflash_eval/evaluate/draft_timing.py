"""T_draft: one drafter step (block forward with the LM head, batch 1) timed on the evaluation device.

The step is what the live loop's drafter does per verification step: project the target states of
the tokens the last step accepted into its KV cache (fc, hidden_norm, each layer's k/v: the per-step
context projection), then the evaluator's own block forward for one anchor at a block size b, its
LM head over b - 1 positions and their argmax. The older context is already projected (what a
serving drafter's KV cache holds); the anchor is at the profile's context length or the longest
cached sample's, whichever is shorter. Timed only when the profile does not give it.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.speedup.timing import timed_ms, wanted


@torch.inference_mode()
def drafter_step_ms(runner: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, context_tokens: int,
                    repeats: int, block_size: int | None = None, project_tokens: int = 1) -> dict[str, Any]:
    """Median ms (and spread) of one drafter step at anchor min(context_tokens, T - 1): the projection of
    `project_tokens` new context rows, then a block of `block_size` (the drafter's own by default) + LM head."""
    block = runner.block_size if block_size is None else int(block_size)
    if not 2 <= block <= runner.block_size:
        raise ValueError(f"a drafter step of block {block}: the drafter drafts blocks of 2..{runner.block_size}")
    anchor = max(0, min(int(context_tokens), tokens.shape[0] - 1))
    project = max(1, min(int(project_tokens), anchor + 1))
    context = runner.context(features[:anchor + 1])
    anchors = torch.tensor([anchor], device=tokens.device)

    def step() -> None:
        runner.context(features[anchor + 1 - project:anchor + 1])  # the per-step projection (its cost only)
        runner.logits(runner.block_hidden(context, tokens[:anchor + 1], anchors, block, ctx_len=anchor)).argmax(-1)

    timing = timed_ms(step, tokens.device, repeats, budget_s=2.0)
    return {**timing, "context_tokens": anchor, "block_size": block, "project_tokens": project,
            "device": str(tokens.device)}


def time_on_cache(runner: BlockDrafter, cache, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
                  options: dict[str, Any], projections: dict[int, int]) -> dict[str, Any] | None:
    """drafter_step_ms at each block size (-> the context rows its step projects), on the cache's longest
    sample (the closest to a typical serving context): {"by_block": {b: timing}, "device", "context_tokens"}."""
    if not cache.samples or not wanted(options, device):
        return None
    longest = max(cache.samples, key=lambda sample: int(sample["length"]))
    states = cache.load_sample(str(longest["id"]), layer_ids)
    features, tokens = states.features.to(device=device, dtype=dtype), states.input_ids.to(device)
    by_block = {int(block): drafter_step_ms(runner, features, tokens, int(options["context_tokens"]),
                                            int(options["repeats"]), int(block), rows)
                for block, rows in projections.items() if 2 <= int(block) <= runner.block_size}
    if not by_block:
        return None
    first = next(iter(by_block.values()))
    return {"by_block": by_block, "device": first["device"], "context_tokens": first["context_tokens"]}
