"""T_draft: one drafter step (block forward with the LM head, batch 1) timed on the evaluation device.

The step is the evaluator's own block forward for one anchor, its context's keys and values
already projected (what a serving drafter's KV cache holds), at the profile's context length or
the longest cached sample's, whichever is shorter. Timed only when the profile does not give it.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.speedup.timing import timed_ms, wanted


@torch.inference_mode()
def drafter_step_ms(runner: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, context_tokens: int,
                    repeats: int) -> dict[str, Any]:
    """Median ms (and spread) of one block forward + LM head at anchor min(context_tokens, T - 1)."""
    anchor = max(0, min(int(context_tokens), tokens.shape[0] - 1))
    context = runner.context(features[:anchor + 1])
    anchors = torch.tensor([anchor], device=tokens.device)

    def step() -> None:
        runner.logits(runner.block_hidden(context, tokens[:anchor + 1], anchors, ctx_len=anchor))

    timing = timed_ms(step, tokens.device, repeats, budget_s=2.0)
    return {**timing, "context_tokens": anchor, "device": str(tokens.device)}


def time_on_cache(runner: BlockDrafter, cache, layer_ids: list[int], device: torch.device, dtype: torch.dtype,
                  options: dict[str, Any]) -> dict[str, Any] | None:
    """drafter_step_ms on the cache's longest sample (the closest to a typical serving context)."""
    if not cache.samples or not wanted(options, device):
        return None
    longest = max(cache.samples, key=lambda sample: int(sample["length"]))
    states = cache.load_sample(str(longest["id"]), layer_ids)
    return drafter_step_ms(runner, states.features.to(device=device, dtype=dtype), states.input_ids.to(device),
                           int(options["context_tokens"]), int(options["repeats"]))
