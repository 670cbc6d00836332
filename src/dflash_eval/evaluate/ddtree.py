"""DDTree acceptance from one block of drafter logits, for many anchors and budgets at once.

How, in detail: docs/internals.md (`evaluate/ddtree.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch


def truth_path_ranks(
    logits: torch.Tensor, truth: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-`width` log-probs per position and where the true token lies in them.

    logits [m, P, V], truth [m, P] (-1 where there is no true token). Returns the top log-probs
    [m, P, width] (float32), a bool [m, P] saying the truth node exists down to each depth, and the truth
    path's score [m, P], summed in path order as the tree sums it.

    The top-k runs on the logits themselves and the log-probs are gathered at its indices: a row's log-probs
    are its logits less one constant, so the top `width` logits are top `width` log-probs and the sorted values
    are the same bits as a top-k of the log-probs. On bf16 logits the top-k reads half the bytes, and a
    log-softmax that reads bf16 and writes float32 gives the bits of one over a float32 copy, without the copy
    (benchmarks/results/ddtree_parts.md).
    """
    _, indices = torch.topk(logits, width, dim=-1)
    values = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, indices)
    match = indices == truth[..., None]
    in_top = match.any(dim=-1) & (truth >= 0)
    exists = in_top.to(torch.int64).cumprod(dim=-1).bool()
    step = torch.where(match, values, torch.zeros_like(values)).sum(dim=-1)  # one term or none: exact
    scores, total = [], torch.zeros_like(step[:, 0])
    for depth in range(step.shape[1]):
        total = total + step[:, depth]
        scores.append(total)
    truth_score = torch.stack(scores, dim=1) if scores else step
    return values, exists, truth_score


@functools.lru_cache(maxsize=4096)
def candidate_pairs(budget: int, parents: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent rank i < parents, token rank j < width) pairs with (i + 1)(j + 1) <= budget.

    Made on the host and kept: they depend on three integers only, and building them on a GPU took a dozen launches
    and two waits per depth."""
    counts = np.minimum(budget // np.arange(1, parents + 1), width)
    parent = np.repeat(np.arange(parents), counts)
    token = np.arange(len(parent)) - np.repeat(np.cumsum(counts) - counts, counts)
    return torch.from_numpy(parent).to(device), torch.from_numpy(token).to(device)


def better_node_counts(
    values: torch.Tensor, truth_score: torch.Tensor, exists: torch.Tensor, budget: int, host_reads: bool = True
) -> torch.Tensor:
    """For each depth, how many tree nodes score strictly above the truth node: [m, P].

    values [m, P, W] are the per-position top-W log-probs (W = min(budget, vocabulary)). Counts are
    exact below `budget` where the truth node exists; `budget` means "not in any tree of that budget".
    The host reads two numbers per depth, in one wait: the widest beam left (0: every anchor is finished) and how
    many of the next position's ranks can still give a useful child. A beam row is sorted, so a finished anchor's
    row is all -inf and adds nothing to either.

    `host_reads` False (the trajectory evaluator's scorer on every device: faster on CUDA, not slower on the CPU,
    benchmarks/results/evaluator_speed.md): no host read at all; every anchor stays in the beam
    to the last depth with every token rank a child (a finished anchor's beam is all -inf). The extra nodes are
    real tree nodes that score at or below every undecided truth score, so no count changes: what enters `best`
    from them cannot exceed an open truth score, and a closed one already has `budget` better nodes.
    """
    if not host_reads:
        return better_node_counts_on_device(values, truth_score, exists, budget)
    m, positions = values.shape[:2]
    device, neg_inf = values.device, torch.tensor(float("-inf"), device=values.device)
    best = torch.full((m, budget), float("-inf"), dtype=values.dtype, device=device)  # best nodes found, sorted
    active = torch.arange(m, device=device)
    beam, floor, useful = values[:, 0], None, 0
    for depth in range(positions):
        if depth > 0:
            tokens = values[active, depth]
            parent, token = candidate_pairs(budget, beam.shape[1], max(useful, 1), device)
            candidates = beam[:, parent] + tokens[:, token]
            beam = torch.topk(candidates, min(budget, candidates.shape[1]), dim=-1).values
        merged = torch.topk(torch.cat([best[active], beam], dim=1), budget, dim=-1).values
        best[active] = merged
        # truth depths still undecided: the node exists and scores at least the budget-th best known
        scores = truth_score[active]
        open_ = exists[active] & (scores >= merged[:, budget - 1 : budget])
        floor = torch.where(open_, scores, torch.full_like(scores, float("inf"))).min(dim=1).values
        beam = torch.where(beam > floor[:, None], beam, neg_inf)
        if depth + 1 == positions:
            break
        width = (beam > neg_inf).sum(dim=1).max()
        ranks = (values[active, depth + 1] + beam[:, :1] > floor[:, None]).sum(dim=1).max()  # ranks worth a child
        width, useful = torch.stack([width, ranks]).tolist()
        if width == 0:
            break
        keep = torch.nonzero(beam[:, 0] > neg_inf)[:, 0]
        active, beam, floor = active[keep], beam[keep, :width], floor[keep]
    return (best[:, None, :] > truth_score[:, :, None]).sum(dim=-1)


def better_node_counts_on_device(
    values: torch.Tensor, truth_score: torch.Tensor, exists: torch.Tensor, budget: int
) -> torch.Tensor:
    """better_node_counts without a host read: fixed shapes at every depth (so also a CUDA graph could hold it)."""
    m, positions, width = values.shape
    neg_inf = torch.tensor(float("-inf"), device=values.device)
    best = torch.full((m, budget), float("-inf"), dtype=values.dtype, device=values.device)
    beam = values[:, 0]
    for depth in range(positions):
        if depth > 0:
            parent, token = candidate_pairs(budget, beam.shape[1], width, values.device)
            candidates = beam[:, parent] + values[:, depth][:, token]
            beam = torch.topk(candidates, min(budget, candidates.shape[1]), dim=-1).values
        best = torch.topk(torch.cat([best, beam], dim=1), budget, dim=-1).values
        open_ = exists & (truth_score >= best[:, budget - 1 : budget])
        floor = torch.where(open_, truth_score, torch.full_like(truth_score, float("inf"))).min(dim=1).values
        beam = torch.where(beam > floor[:, None], beam, neg_inf)
    return (best[:, None, :] > truth_score[:, :, None]).sum(dim=-1)


def tree_accepted(
    logits: torch.Tensor, truth: torch.Tensor, budgets: Sequence[int], host_reads: bool = True
) -> torch.Tensor:
    """Accepted draft length (deepest matching path) for each budget: [len(budgets), m].

    logits [m, P, V] are the drafter's block logits for positions 1..P; truth [m, P] the true next
    tokens (-1 past the end of the sequence). `host_reads`: see better_node_counts.
    """
    budgets = [int(b) for b in budgets]
    m, positions, vocab = logits.shape
    if positions == 0 or m == 0:
        return torch.zeros(len(budgets), m, dtype=torch.int64, device=logits.device)
    width = min(max(budgets), vocab)
    values, exists, truth_score = truth_path_ranks(logits, truth, width)
    better = better_node_counts(values, truth_score, exists, max(budgets), host_reads)
    out = []
    for budget in budgets:
        inside = exists & (better < budget)
        out.append(inside.to(torch.int64).cumprod(dim=-1).sum(dim=-1))
    return torch.stack(out)
