"""The demo server's speculation at temperature > 0: SGLang 0.5.23's DFlash loop with target-only verification.

Drafts stay greedy (the drafter's argmax, as SGLang's DFlash worker proposes them at any temperature);
verification is demo.sglang_sampling.target_only_verify against verify_probs; the first token comes from the
sampler (sampler_probs). Every block is verified full and the output cut afterwards at the first stop token or
at max_new_tokens, as SGLang's worker does (speculative/dflash_worker_v2.py), so the steps are SGLang's raw
ones. The coins come from one torch.Generator seeded with the request's sampling_seed (42 when none, SGLang's
default seed): the same request gives the same completion and counters.

The target runs without a cache, one full forward per step over the prompt, the output so far and the block:
exact for the hybrid target with no rollback to get right (the demo's sequences are short). The drafter is
dflash 0.1.0's own module, called as dflash_generate calls it, on the target's hidden states of every
position before the block (its cache only saves that recomputation).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_eval.demo.sglang_sampling import (
    draw,
    sampler_probs,
    target_only_verify,
    verify_probs,
)

DEFAULT_SEED = 42  # sampling/sampling_batch_info.py: a request without sampling_seed


def _forward(target: Any, ids: list[int], layer_ids: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits at every position and, for drafting, the drafter's context features."""
    from dflash.model import extract_context_feature

    out = target(torch.tensor([ids]), output_hidden_states=layer_ids is not None, use_cache=False)
    context = None if layer_ids is None else extract_context_feature(out.hidden_states, layer_ids)
    return out.logits[0], context


def _draft(drafter: Any, target: Any, context: torch.Tensor, last: int, start: int, block_size: int) -> list[int]:
    """The drafter's B - 1 greedy drafts after `last` (the block's first token, at position `start`), conditioned
    on context[:, :start]."""
    from dflash.model import _draft_value, _output_head, _raw_input_embeddings

    block = torch.full((1, block_size), int(drafter.mask_token_id), dtype=torch.long)
    block[0, 0] = last
    noise = _raw_input_embeddings(target, block, float(_draft_value(drafter.config, "input_embedding_scale", 1.0)))
    positions = torch.arange(start + block_size).unsqueeze(0)
    hidden = drafter(
        target_hidden=context[:, :start],
        noise_embedding=noise,
        position_ids=positions,
        past_key_values=None,
        use_cache=False,
    )[:, 1 - block_size :, :]
    return [int(t) for t in drafter.compute_logits(hidden, _output_head(target)).argmax(dim=-1)[0]]


def sampled_generate(
    drafter: Any,
    target: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    stops: list[int],
    block_size: int,
    drawn: dict[str, Any],
    thresholds: tuple[float, float] = (1.0, 1.0),
) -> tuple[list[int], list[int]]:
    """A sampled completion (stop token included) and SGLang's raw steps (tokens each verification produced)."""
    seed = drawn.get("seed")
    generator = torch.Generator().manual_seed(DEFAULT_SEED if seed is None else int(seed))
    temperature, top_p, top_k = float(drawn["temperature"]), float(drawn["top_p"]), int(drawn["top_k"])
    layer_ids = list(drafter.target_layer_ids) if drafter is not None else None
    logits, context = _forward(target, prompt_ids, layer_ids)
    first = sampler_probs(logits[-1:], temperature, top_p, top_k, float(drawn["min_p"]))[0]
    completion = [draw(first, float(torch.rand((), generator=generator)))]
    steps: list[int] = []

    def done() -> bool:
        return completion[-1] in stops or len(completion) >= max_new_tokens

    while not done():
        start = len(prompt_ids) + len(completion) - 1  # the position of the last token, the block's first
        if drafter is None:  # no speculation: every token from the sampler, as the first
            logits, _ = _forward(target, prompt_ids + completion, None)
            probs = sampler_probs(logits[-1:], temperature, top_p, top_k, float(drawn["min_p"]))[0]
            completion.append(draw(probs, float(torch.rand((), generator=generator))))
            continue
        candidates = [completion[-1]] + _draft(drafter, target, context, completion[-1], start, block_size)
        logits, context = _forward(target, prompt_ids + completion[:-1] + candidates, layer_ids)
        probs = verify_probs(logits[start:], temperature, top_p, top_k)
        coins = torch.rand((len(candidates),), generator=generator).tolist()
        final = float(torch.rand((), generator=generator))
        accepted, bonus = target_only_verify(candidates, probs, coins, final, *thresholds)
        completion += candidates[1 : accepted + 1] + [bonus]
        steps.append(accepted + 1)
    for index, token in enumerate(completion):  # the output is cut after its first stop token, then at the cap
        if token in stops:
            completion = completion[: index + 1]
            break
    return completion[:max_new_tokens], steps
