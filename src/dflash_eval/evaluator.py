"""One sample's offline evaluation: drafts at every anchor, then the online trajectory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .acceptance import SequenceLimits, chain_steps, matched_prefix, verify_sizes
from .blocks import BlockDrafter


@dataclass
class SampleResult:
    """Per-anchor matched draft lengths and the chain trajectory they imply."""

    accepted: np.ndarray   # [n_anchors] matched draft tokens at anchors prompt_len..total_len-2
    steps: list[int]       # tokens produced per verification step


@torch.inference_mode()
def accepted_at_anchors(drafter: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor,
                        limits: SequenceLimits, chunk: int = 128) -> np.ndarray:
    """Matched draft length at every anchor, with the block length the online loop would use there.

    Near the token budget the online loop shortens the block (fewer mask tokens), which changes a
    non-causal drafter's output; those anchors run with their own, shorter block.
    """
    sizes = verify_sizes(limits, drafter.block_size)
    accepted = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) == 0:
        return accepted
    context = drafter.context(features)
    anchors_all = torch.arange(limits.prompt_len, limits.total_len - 1, device=features.device)
    for size in np.unique(sizes):
        index = np.nonzero(sizes == size)[0]
        for begin in range(0, len(index), chunk):
            part = torch.as_tensor(index[begin:begin + chunk], device=features.device)
            anchors = anchors_all[part]
            if size <= 1:
                continue  # a block of one token drafts nothing: the step yields only the bonus token
            hidden = drafter.block_hidden(context, tokens, anchors, block_size=int(size))
            draft = drafter.logits(hidden).argmax(dim=-1)
            accepted[part.cpu().numpy()] = matched_prefix(draft, tokens, anchors).cpu().numpy()
    return accepted


def evaluate_sample(drafter: BlockDrafter, features: torch.Tensor, tokens: torch.Tensor, limits: SequenceLimits,
                    stop_ids: set[int], chunk: int = 128) -> SampleResult:
    """Chain evaluation of one sample from its cached features [T, n_layers * H] and tokens [T]."""
    accepted = accepted_at_anchors(drafter, features, tokens, limits, chunk)
    token_list = tokens.tolist()
    is_stop = [t in stop_ids for t in token_list]
    return SampleResult(accepted=accepted, steps=chain_steps(accepted, limits, is_stop))
