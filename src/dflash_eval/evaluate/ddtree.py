"""DDTree acceptance from one block of drafter logits, for many anchors and budgets at once.

DDTree-N builds a tree of N nodes besides the root, best-first: a node at depth d holds one of the
drafter's top-N tokens for block position d, its score is the sum of the log-probabilities along
its path; pop the best node, push its next sibling (same parent, next rank) and its first child
(rank 0 at depth d + 1). The target verifies the tree; the accepted length is the deepest root path
whose tokens match the target's greedy continuation, plus the bonus token.

A heap per anchor is slow in Python, so we use what best-first order implies. Scores only fall along
child and sibling edges, so the node popped k-th has exactly k nodes of higher score in the whole
(unbounded) tree, and the first N pops are the N best nodes (ranks >= N can never be among them:
a rank-r node needs its r better siblings popped first). Hence the truth path's node at depth d is
in the DDTree-N tree iff fewer than N nodes score strictly better than it. All nodes that could be
among the best N_max at depth d are children of the best N_max at depth d - 1, so a per-depth top-N
beam over [anchors, N x N] candidates enumerates every node we need to count. Exact except where two
scores tie bit for bit, where the heap's tie-break is arbitrary anyway.
"""

from __future__ import annotations

from typing import Sequence

import torch


def truth_path_ranks(logprobs: torch.Tensor, truth: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-`width` log-probs per position and where the true token lies in them.

    logprobs [m, P, V], truth [m, P] (-1 where there is no true token). Returns the top values
    [m, P, width], a bool [m, P] saying the truth node exists down to each depth, and the truth
    path's cumulative score [m, P].
    """
    values, indices = torch.topk(logprobs, width, dim=-1)
    match = indices == truth[..., None]
    in_top = match.any(dim=-1) & (truth >= 0)
    exists = in_top.to(torch.int64).cumprod(dim=-1).bool()
    picked = torch.where(match, values, torch.zeros_like(values)).sum(dim=-1)
    # Added one depth at a time, as better_node_counts adds the beam: the truth node's own score there
    # is then the same float, never "better" than itself (cumsum rounds differently: in double on CPU).
    running, truth_score = torch.zeros_like(picked[:, 0]), torch.empty_like(picked)
    for depth in range(picked.shape[1]):
        running = running + picked[:, depth]
        truth_score[:, depth] = running
    return values, exists, truth_score


def better_node_counts(values: torch.Tensor, truth_score: torch.Tensor, budget: int) -> torch.Tensor:
    """For each depth, how many tree nodes (among those that matter) score above the truth node.

    values [m, P, W] are the per-position top-W log-probs (W = min(budget, vocabulary)). Counts are
    exact below `budget`; a count of `budget` or more only says "not in any tree of that budget".
    """
    m, positions, _ = values.shape
    beam = torch.zeros(m, 1, dtype=values.dtype, device=values.device)
    beams = []
    for depth in range(positions):
        candidates = (beam[:, :, None] + values[:, depth, None, :]).reshape(m, -1)
        beam = torch.topk(candidates, min(budget, candidates.shape[1]), dim=-1).values
        beams.append(beam)
    every = torch.cat(beams, dim=1)  # [m, P * W], the best W nodes of each depth
    return (every[:, None, :] > truth_score[:, :, None]).sum(dim=-1)


def tree_accepted(logits: torch.Tensor, truth: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """Accepted draft length (deepest matching path) for each budget: [len(budgets), m].

    logits [m, P, V] are the drafter's block logits for positions 1..P; truth [m, P] the true next
    tokens (-1 past the end of the sequence).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    width = min(max(budgets), logprobs.shape[-1])
    values, exists, truth_score = truth_path_ranks(logprobs, truth, width)
    better = better_node_counts(values, truth_score, max(budgets))
    out = []
    for budget in budgets:
        inside = exists & (better < budget)
        out.append(inside.to(torch.int64).cumprod(dim=-1).sum(dim=-1))
    return torch.stack(out)
