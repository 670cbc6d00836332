"""The DDTree scorer as it was before the truth-path pruning (commit e91893b): a top-N beam per
depth over all N x N (parent, token) candidates. Kept as the reference the pruned one must equal,
and as the "before" side of benchmarks/ddtree_speed.py.

`path_order_sum=False` is that version exactly: its truth score was a cumsum, which on CPU
accumulates in float64 and so can differ in the last bit from the node's own float32 score (the
truth node then counts as better than itself). `True` sums in path order, as the tree does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def beam_tree_accepted(
    logits: torch.Tensor, truth: torch.Tensor, budgets: Sequence[int], path_order_sum: bool = True
) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    budget = max(budgets)
    width = min(budget, logprobs.shape[-1])
    values, indices = torch.topk(logprobs, width, dim=-1)
    match = indices == truth[..., None]
    exists = (match.any(dim=-1) & (truth >= 0)).to(torch.int64).cumprod(dim=-1).bool()
    step = torch.where(match, values, torch.zeros_like(values)).sum(dim=-1)
    if path_order_sum:
        totals, total = [], torch.zeros_like(step[:, 0])
        for depth in range(step.shape[1]):
            total = total + step[:, depth]
            totals.append(total)
        truth_score = torch.stack(totals, dim=1)
    else:
        truth_score = step.cumsum(dim=-1)
    m, positions, _ = values.shape
    beam = torch.zeros(m, 1, dtype=values.dtype, device=values.device)
    beams = []
    for depth in range(positions):
        candidates = (beam[:, :, None] + values[:, depth, None, :]).reshape(m, -1)
        beam = torch.topk(candidates, min(budget, candidates.shape[1]), dim=-1).values
        beams.append(beam)
    better = (torch.cat(beams, dim=1)[:, None, :] > truth_score[:, :, None]).sum(dim=-1)
    return torch.stack([(exists & (better < b)).to(torch.int64).cumprod(dim=-1).sum(dim=-1) for b in budgets])
