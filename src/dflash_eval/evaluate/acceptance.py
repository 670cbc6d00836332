"""From per-anchor draft results to what the greedy reference loop would have accepted.

Follows `dflash.model.dflash_generate` at temperature 0 step by step: the first verification
starts at the first completion token (the target's prefill output); each step accepts the longest
matching prefix of the draft plus the bonus token, capped by the remaining token budget, and cut at
the first stop token. Greedy verification is against the completion tokens, which are the target's
own greedy output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SequenceLimits:
    """Where one sample's reference loop starts and must end."""

    prompt_len: int  # index of the first completion token (the loop's first anchor)
    total_len: int  # prompt + completion tokens available offline
    max_length: int  # prompt_len + max_new_tokens, as the reference loop computes it


def sequence_limits(
    prompt_len: int, total_len: int, max_new_tokens: int | None, ends_with_stop: bool
) -> SequenceLimits:
    """The reference loop's max_length; without a final stop token the completion's end is the limit.

    A completion that stopped on a stop token could have run to prompt_len + max_new_tokens; one
    that did not (length limit, or a server-side stop string) gives us no tokens past its end, so
    the loop must end there.
    """
    max_length = total_len
    if ends_with_stop and max_new_tokens is not None:
        max_length = max(prompt_len + max_new_tokens, total_len)
    return SequenceLimits(prompt_len=prompt_len, total_len=total_len, max_length=max_length)


def verify_sizes(limits: SequenceLimits, block_size: int) -> np.ndarray:
    """Block length the reference loop uses at each anchor in [prompt_len, total_len - 1)."""
    anchors = np.arange(limits.prompt_len, limits.total_len - 1)
    return np.minimum(block_size, limits.max_length - anchors)


def matched_prefix(draft: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Leading matches of draft [m, k] against tokens[s+1 : s+1+k] for each anchor s (bounded by T)."""
    m, k = draft.shape
    positions = anchors[:, None] + 1 + torch.arange(k, device=draft.device)[None]
    inside = positions < tokens.shape[0]
    truth = tokens[positions.clamp(max=tokens.shape[0] - 1)]
    hits = (draft == truth) & inside
    return hits.to(torch.int64).cumprod(dim=1).sum(dim=1)


def chain_steps(accepted: Sequence[int], limits: SequenceLimits, is_stop: Sequence[bool]) -> list[int]:
    """Tokens produced per verification step (the reference's `acceptance_lengths`).

    `accepted[i]` is the matched draft length at anchor prompt_len + i; `is_stop[t]` says whether
    token t is a stop token.
    """
    start = limits.prompt_len
    steps: list[int] = []
    stopped = bool(is_stop[start]) if start < limits.total_len else True
    while start + 1 < limits.max_length and not stopped:
        if start + 1 >= limits.total_len:
            raise ValueError(f"offline trajectory ran past the completion at position {start}")
        produced = min(int(accepted[start - limits.prompt_len]) + 1, limits.max_length - start - 1)
        for offset in range(1, produced + 1):
            if is_stop[start + offset]:
                produced, stopped = offset, True
                break
        start += produced
        steps.append(produced)
    return steps
