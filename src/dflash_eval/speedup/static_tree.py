"""A DDTree live loop on the static-cache machinery (static_loop.py): per step the drafter's block forward, a tree
of N nodes built best-first from its log-probabilities, one target pass over the N + 1 tokens [bonus, nodes]
under a tree mask, the deepest accepted path, and its keys compacted to the positions after the context.

The tree is DDTree's (liranringel/ddtree; evaluate/ddtree.py scores the same tree offline): a node at depth d
holds one of the drafter's top-N tokens for block position d, its score the sum of the log-probabilities along
its path (float32, in path order); pop the best, push its next sibling and its first child, N pops. Node i sits
in cache slot start + i at position start + depth(i) and sees the context and its own ancestors. The accepted
path follows, from the root, the child whose token is the target's argmax at its parent; the bonus is the
target's argmax at the path's last node. Then the path's keys move to slots start.. (no other state: pure
attention), the drafter projects the path's features.

Simulated acceptance (`simulate_tau`): k - 1 drafts are accepted along the tree's best path (from the root, each
node's best-scoring child), k drawn as speedup/simulate.py draws it, capped at the path's depth; the bonus is the
target's argmax at the last node with the path's next token excluded (chain's rule, real-draft-token). A random
drafter's distributions are flat, so its best-first tree is one level deep and no k > 2 could be forced; the
simulated tree therefore takes the drafter's greedy chain as its spine first (its P nodes, then N - P best-first),
the shape a confident trained drafter's tree has. The verify's cost is the same for any shape of N + 1 nodes.

The drafter's forward and the target's verify are CUDA graphs on CUDA (one per budget); building the tree and
walking it run on the host, with one device-to-host copy each (their time is reported: `host_s`).
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from dflash_eval.speedup.loop_run import LoopRun
from dflash_eval.speedup.simulate import simulated_length
from dflash_eval.speedup.static_loop import StaticLoop, capture


@dataclass(frozen=True)
class TreeRun(LoopRun):
    """A LoopRun with the ids it produced and the host's share of the decode (tree building and walking)."""

    output_ids: torch.Tensor
    host_s: float


def build_tree(log_probs: np.ndarray, tokens: np.ndarray, budget: int,
               spine: bool = False) -> tuple[list[int], list[int], list[int]]:
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
        heapq.heappush(heap, (-float(np.float32(scores[parent] + log_probs[depth - 1, rank])), order, depth, rank,
                              parent))
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


class TreeLoop(StaticLoop):
    """DDTree at `budgets` for a drafter of block `block` (P = block - 1 positions), and the chain/autoregressive
    steps of StaticLoop at [block] (its prefill, its size-1 baseline)."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module, max_len: int, block: int,
                 budgets: list[int], graphs: bool):
        self.block, self.budgets = int(block), sorted({int(n) for n in budgets})
        super().__init__(target, drafter, max_len + max(self.budgets) + 1, [self.block], graphs)
        self.max_len = int(max_len)  # what a generation may reach; the cache also holds the last tree
        with torch.inference_mode():
            vocab = int(target.get_input_embeddings().weight.shape[0])
            long = dict(device=self.device, dtype=torch.long)
            self.draft_logits = torch.zeros(self.block - 1, vocab, device=self.device, dtype=self.target.dtype)
            self.tree_ids = {n: torch.zeros(1, n + 1, **long) for n in self.budgets}
            self.depths = {n: torch.zeros(n + 1, **long) for n in self.budgets}
            self.masks = {n: torch.eye(n + 1, device=self.device, dtype=torch.bool) for n in self.budgets}
            self.tree_logits = {n: torch.zeros(n + 1, vocab, device=self.device, dtype=self.target.dtype)
                                for n in self.budgets}
            width = self.features[self.block].shape[1]
            self.tree_features = {n: torch.zeros(n + 1, width, device=self.device, dtype=self.target.dtype)
                                  for n in self.budgets}
        self.trace: list[torch.Tensor] | None = None  # set to a list to keep each step's draft logits (tests)
        self.tree_draft = capture(self._tree_draft, self.device, self.graphs, reset=self.start.zero_)
        self.tree_verify = {n: capture(lambda n=n: self._tree_verify(n), self.device, self.graphs,
                                       reset=self.start.zero_) for n in self.budgets}

    def _tree_draft(self) -> None:
        b = self.block
        self.draft_logits.copy_(self.drafter.draft_logits(self.features[b], self.ctx_start, self.ids[b][0, :1],
                                                          self.start, b))

    def _tree_verify(self, n: int) -> None:
        logits, features = self.target.forward(self.tree_ids[n], self.start, features=True,
                                               tree=(self.depths[n], self.masks[n]))
        self.tree_logits[n].copy_(logits)
        self.tree_features[n].copy_(features)

    @torch.inference_mode()
    def generate_tree(self, prompt: torch.Tensor, max_new_tokens: int, budget: int,
                      simulate_tau: float | None = None, seed: int = 0) -> TreeRun:
        """Greedy generation of `max_new_tokens` tokens with DDTree-`budget` (acceptance simulated at
        `simulate_tau` when given)."""
        if budget not in self.budgets:
            raise ValueError(f"budget {budget} was not captured (budgets {self.budgets})")
        b = self.block
        n = self.prefill(prompt, b)
        max_length = n + int(max_new_tokens)
        if max_length + 1 > self.max_len:
            raise ValueError(f"{n} + {max_new_tokens} tokens do not fit a loop of max_len {self.max_len}")
        rng = random.Random(seed)
        width = min(budget, self.draft_logits.shape[1])
        out = self.out[:n + 1].tolist()
        lengths: list[int] = []
        host_s = 0.0
        start = n
        self._sync()
        began = time.perf_counter()
        while start + 1 < max_length:
            forced = simulated_length(simulate_tau, b, rng) if simulate_tau is not None else None
            self.tree_draft()
            if self.trace is not None:
                self.trace.append(self.draft_logits.clone())
            top = torch.log_softmax(self.draft_logits.float(), -1).topk(width, -1)
            values, tokens = top.values.cpu().numpy(), top.indices.cpu().numpy()  # host read 1
            clock = time.perf_counter()
            parents, depths, node_tokens = build_tree(values, tokens, budget, spine=simulate_tau is not None)
            size = len(parents)
            node_tokens[0] = out[-1]
            ids = np.zeros(budget + 1, dtype=np.int64)
            ids[:size] = node_tokens
            mask = np.zeros((budget + 1, budget + 1), dtype=bool)
            mask[:size, :size] = ancestors(parents)
            np.fill_diagonal(mask, True)  # unused slots (a vocab smaller than the budget) see only themselves
            depth = np.zeros(budget + 1, dtype=np.int64)
            depth[:size] = depths
            host_s += time.perf_counter() - clock
            self.tree_ids[budget][0].copy_(torch.from_numpy(ids))
            self.depths[budget].copy_(torch.from_numpy(depth))
            self.masks[budget].copy_(torch.from_numpy(mask))
            self.tree_verify[budget]()
            argmax = self.tree_logits[budget].argmax(-1).cpu().numpy()  # host read 2
            clock = time.perf_counter()
            path, bonus = self._walk(parents, node_tokens, argmax, forced, budget)
            host_s += time.perf_counter() - clock
            accepted = len(path) - 1
            produced = min(accepted + 1, max_length - start - 1)
            out.extend([node_tokens[i] for i in path[1:]] + [bonus])
            slots = torch.tensor(path, device=self.device) + start
            self.target.compact(start, slots)
            rows = torch.zeros(b, self.tree_features[budget].shape[1], device=self.device,
                               dtype=self.target.dtype)
            rows[:len(path)] = self.tree_features[budget][torch.tensor(path, device=self.device)]
            self.features[b].copy_(rows)
            self.ctx_start.fill_(start)
            start += accepted + 1
            self.start.fill_(start)
            self.ids[b][0, 0] = bonus
            lengths.append(produced)
        self._sync()
        decode_s = time.perf_counter() - began
        return TreeRun(decode_s, 1 + sum(lengths), lengths, torch.tensor(out[:max_length])[None], host_s)

    def _walk(self, parents: list[int], node_tokens: list[int], argmax: np.ndarray, forced: int | None,
              budget: int) -> tuple[list[int], int]:
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents[1:], start=1):
            children.setdefault(parent, []).append(node)  # in pop order: best-scoring child first
        path = [0]
        if forced is None:
            while True:
                match = [c for c in children.get(path[-1], []) if node_tokens[c] == argmax[path[-1]]]
                if not match:
                    return path, int(argmax[path[-1]])
                path.append(match[0])
        while len(path) < forced and children.get(path[-1]):
            path.append(children[path[-1]][0])
        last = path[-1]
        row = self.tree_logits[budget][last].float().clone()
        if children.get(last):  # the path goes on: its next token is the one the target rejected
            row[node_tokens[children[last][0]]] = float("-inf")
        return path, int(row.argmax())
