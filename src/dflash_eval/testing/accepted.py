"""Token sequences on which a drafter's own drafts are accepted at a chosen rate (tests, benchmarks).

Random tokens give tau 1 and hide what an evaluator costs at a realistic acceptance. The drafter's
block at anchor s depends only on the context features before s and the token at s, so with the
features fixed we can write the sequence as the chain goes: at the anchor the chain reaches, take
the drafter's draft, keep its first a tokens, then write a token that differs from draft[a]; the
next anchor is s + a + 1. Every evaluator's chain-B trajectory then takes exactly these steps (up to
rounding where two logits nearly tie). a counts leading successes of a per-position acceptance q,
capped at B - 1, with q chosen so that the expected tau is the one asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.packed import (
    ContextPool,
    fused_attention_for,
    pack,
    packed_hidden,
)


def acceptance_rate(tau: float, block: int) -> float:
    """Per-position acceptance q with 1 + sum_{k=1}^{B-1} q^k = tau (bisection)."""
    if not 1.0 <= tau <= block:
        raise ValueError(f"tau {tau} outside 1..{block}")
    low, high = 0.0, 1.0
    for _ in range(60):
        q = (low + high) / 2
        low, high = (q, high) if 1 + sum(q**k for k in range(1, block)) < tau else (low, q)
    return (low + high) / 2


def accepted_tokens(
    runner: BlockDrafter,
    features: list[torch.Tensor],
    prompt_lens: list[int],
    tau: float,
    seed: int = 0,
    vocab: tuple[int, int] = (8, 250),
    rows: int = 64,
    alternative: float = 0.0,
) -> list[torch.Tensor]:
    """One token sequence [T_i] per sample (features [T_i, n_layers * H]) with chain-B tau about `tau`.

    Free tokens (prompt, rejections) are drawn from `vocab` [low, high); keep stop tokens outside it. With
    probability `alternative` a rejection writes the drafter's best other token there instead (a tree
    that holds it accepts more than the chain).
    """
    with torch.inference_mode():  # the returned tensors are made outside it: callers may edit them
        rng = np.random.default_rng(seed)
        block, device = runner.block_size, runner.embed.device
        q = acceptance_rate(tau, block)
        lengths = [f.shape[0] for f in features]
        capacity = max(lengths)
        pool = ContextPool(runner, len(features), capacity, device, runner.embed.dtype)
        for slot, f in enumerate(features):
            pool.write(slot, runner, f)
        cos, sin = runner.rotary(capacity + block + 1, pool.keys[0])
        tokens = np.full((len(features), capacity + block + 1), -1, dtype=np.int64)
        for slot, length in enumerate(lengths):
            tokens[slot, :length] = rng.integers(*vocab, size=length)
        anchor = np.array(prompt_lens, dtype=np.int64)
        lengths = np.array(lengths)
        while (anchor < lengths - 1).any():
            going = np.nonzero(anchor < lengths - 1)[0]
            for lo in range(0, len(going), rows):
                slot = going[lo : lo + rows]
                size = np.minimum(block, lengths[slot] - anchor[slot])
                batch = pack(slot, anchor[slot], size, tokens, runner.mask_token_id, device)
                hidden = packed_hidden(runner, pool, batch, cos, sin, fused_attention_for(device))
                start = np.concatenate([[0], np.cumsum(size)[:-1]])
                drafts: dict[int, tuple[list[int], list[int]]] = {}
                for width in np.unique(size).tolist():
                    members = np.nonzero(size == width)[0]
                    index = torch.from_numpy(start[members][:, None] + np.arange(width)[None]).to(device)
                    states = hidden[index]
                    first = torch.from_numpy(tokens[slot[members], anchor[slot[members]]]).to(device)
                    logits = runner.logits(states)
                    found = runner.draft_tokens(states, logits, first)
                    top = torch.topk(logits, 2, dim=-1).indices
                    other = torch.where(top[..., 0] == found, top[..., 1], top[..., 0])
                    drafts.update(zip(slot[members].tolist(), zip(found.tolist(), other.tolist())))
                for s in slot.tolist():
                    draft, others = drafts[s]
                    kept = 0
                    while kept < len(draft) and rng.random() < q:
                        kept += 1
                    a = int(anchor[s])
                    tokens[s, a + 1 : a + 1 + kept] = draft[:kept]
                    if a + 1 + kept < lengths[s] and kept < len(draft) and rng.random() < alternative:
                        tokens[s, a + 1 + kept] = others[kept]
                    elif a + 1 + kept < lengths[s]:
                        other = int(rng.integers(*vocab))
                        while kept < len(draft) and other == draft[kept]:
                            other = int(rng.integers(*vocab))
                        tokens[s, a + 1 + kept] = other
                    anchor[s] = a + 1 + kept
    return [torch.from_numpy(tokens[slot, :length].copy()).to(device) for slot, length in enumerate(lengths.tolist())]
