"""A DDTree step's tree: built best-first from the drafter's top-k (DDTree's, scored offline by
evaluate/ddtree.py), its ancestors mask, and the buffers its host part fills and uploads in one copy."""

from __future__ import annotations

import heapq

import numpy as np
import torch


def build_tree(
    log_probs: np.ndarray, tokens: np.ndarray, budget: int, spine: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """DDTree's best-first tree from per-position top-k: log_probs, tokens [P, k] (k >= budget or the vocab),
    sorted best first. Returns parents (node 0 is the root), depths and tokens of the N + 1 nodes, root first.
    `spine`: the drafter's greedy chain (rank 0 at every depth) goes in first, the rest best-first (see
    TreeLoop.generate_tree's simulate_tau)."""
    positions, width = log_probs.shape
    parents, depths, node_tokens, scores = [-1], [0], [-1], [np.float32(0.0)]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, depth, rank, parent)
    order = 0

    def push(depth: int, rank: int, parent: int) -> None:
        nonlocal order
        heapq.heappush(
            heap, (-float(np.float32(scores[parent] + log_probs[depth - 1, rank])), order, depth, rank, parent)
        )
        order += 1

    def add(depth: int, rank: int, parent: int) -> int:
        parents.append(parent)
        depths.append(depth)
        node_tokens.append(int(tokens[depth - 1, rank]))
        scores.append(np.float32(scores[parent] + log_probs[depth - 1, rank]))
        if rank + 1 < width:
            push(depth, rank + 1, parent)
        return len(parents) - 1

    chain = min(positions, budget) if spine else 0
    for depth in range(1, chain + 1):
        add(depth, 0, depth - 1)
    if positions and chain < positions:
        push(chain + 1, 0, chain)
    while heap and len(parents) <= budget:
        _, _, depth, rank, parent = heapq.heappop(heap)
        node = add(depth, rank, parent)
        if depth < positions:
            push(depth + 1, 0, node)
    return parents, depths, node_tokens


def ancestors(parents: list[int]) -> np.ndarray:
    """[n, n] bool: j is i or an ancestor of i (parents come before children)."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def tree_buffer(budget: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The bytes of one budget's tree (tree_views): uploaded with one copy."""
    return torch.zeros(16 * (budget + 1) + (budget + 1) ** 2, device=device, dtype=torch.uint8)


def tree_views(buffer: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [1, n + 1], depths [n + 1] (int64) and the ancestor mask [n + 1, n + 1] (bool) over one buffer."""
    m = n + 1
    return (
        buffer[: 8 * m].view(torch.int64).view(1, m),
        buffer[8 * m : 16 * m].view(torch.int64),
        buffer[16 * m :].view(torch.bool).view(m, m),
    )


def draft_top(logits: torch.Tensor, out: torch.Tensor) -> None:
    """The float32 log-softmax top-k of each drafted position (logits [P, V]), sorted, into out [2, P, k]
    (float64: log-probs and token ids both exact there, so one buffer holds both and the host reads it once)."""
    top = torch.log_softmax(logits.float(), -1).topk(out.shape[-1], -1)
    out[0].copy_(top.values)
    out[1].copy_(top.indices)


def fill_tree(top: np.ndarray, budget: int, host: torch.Tensor, spine: bool = False) -> tuple[list[int], list[int]]:
    """A DDTree's per-step host work: build the tree from a read top-k (draft_top's [2, P, k]) and write its
    ids, depths and ancestor mask into `host` (tree_buffer's bytes; the root's id is left 0: a verify puts the
    last bonus there on the device). Returns the tree's parents and node tokens (for the walk)."""
    parents, depths, node_tokens = build_tree(top[0].astype(np.float32), top[1].astype(np.int64), budget, spine=spine)
    size = len(parents)
    ids, depth, mask = (t.numpy() for t in tree_views(host, budget))
    ids[0, :] = 0
    ids[0, 1:size] = node_tokens[1:]
    depth[:] = 0
    depth[:size] = depths
    mask[:] = False
    mask[:size, :size] = ancestors(parents)
    np.fill_diagonal(mask, True)  # unused slots (a vocab smaller than the budget) see only themselves
    return parents, node_tokens


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host twin of a device buffer: pinned on CUDA, so that a copy to or from it is one DMA (and may be
    asynchronous), plain elsewhere (a CPU has nothing to pin)."""
    return torch.zeros(like.shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")
