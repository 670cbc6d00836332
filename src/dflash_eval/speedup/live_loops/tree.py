"""A DDTree live loop on the static-cache forwards: per step the drafter's block, a tree of N nodes
(forwards/tree_step.py), one target pass over [bonus, nodes] under a tree mask, the deepest accepted path, its keys
compacted. The rules, the CUDA graphs and the host's part: docs/speedup_loops.md."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash_eval.speedup.forwards.graphs import capture
from dflash_eval.speedup.forwards.tree_step import (
    draft_top,
    fill_tree,
    host_buffer,
    tree_buffer,
    tree_views,
)
from dflash_eval.speedup.live_loops.chain import StaticLoop
from dflash_eval.speedup.live_loops.run import LoopRun
from dflash_eval.speedup.simulate import simulated_length


@dataclass(frozen=True)
class TreeRun(LoopRun):
    """A LoopRun with the ids it produced and the host's share of the decode: building the trees (with their
    upload; a DDTree drafting step's own part, timed with it by evaluate/draft_timing.py) and walking them."""

    output_ids: torch.Tensor
    build_s: float
    walk_s: float
    phases_s: dict[str, float] | None = None  # breakdown=True: seconds per phase (PHASES), summed over the steps


PHASES = ("draft", "build", "verify", "walk", "accept")


class _Phases:
    """Seconds per phase of a step (PHASES), clocked only when asked: each phase ends synchronised, which a
    timed run must not pay, so a run without it clocks nothing."""

    def __init__(self, sync: Callable[[], None] | None):
        self.sync, self.seconds, self.last = sync, dict.fromkeys(PHASES, 0.0), time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.sync is None:
            return
        self.sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


class TreeLoop(StaticLoop):
    """DDTree at `budgets` for a drafter of block `block` (P = block - 1 positions), and the chain/autoregressive
    steps of StaticLoop at [block] (its prefill, its size-1 baseline).

    Per budget N three steps, each a CUDA graph on CUDA: `tree_draft` (the drafter's block forward and the
    float32 log-softmax top-min(N, V) of its P positions, sorted: one host read of log-probs and tokens
    together), `tree_verify` (the target over [bonus, nodes] under the tree mask, uploaded in one copy, and the
    argmax of every node's row: read only by a greedy walk) and `tree_accept` (the walk's path, uploaded in one
    small copy, applied on the device: the bonus, the path's keys compacted, the drafter's next feature rows,
    the output tokens, the next start). The top-k is taken per budget, not sliced from the largest: a sorted
    top-k orders equal values as its kernel pleases, so a slice need not be the smaller top-k when values tie."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module,
        max_len: int,
        block: int,
        budgets: list[int],
        graphs: bool,
    ):
        self.block, self.budgets = int(block), sorted({int(n) for n in budgets})
        super().__init__(target, drafter, max_len + max(self.budgets) + 1, [self.block], graphs)
        self.max_len = int(max_len)  # what a generation may reach; the cache also holds the last tree
        with torch.inference_mode():
            self._buffers(int(target.get_input_embeddings().weight.shape[0]))
        self.trace: list[torch.Tensor] | None = None  # set to a list to keep each step's draft logits (tests)
        self.tree_draft = {
            n: capture(lambda n=n: self._tree_draft(n), self.device, self.graphs, reset=self.start.zero_)
            for n in self.budgets
        }
        self.tree_verify = {
            n: capture(lambda n=n: self._tree_verify(n), self.device, self.graphs, reset=self.start.zero_)
            for n in self.budgets
        }
        self.tree_accept = {
            n: capture(lambda n=n: self._tree_accept(n), self.device, self.graphs, reset=self._reset_walk)
            for n in self.budgets
        }

    def _buffers(self, vocab: int) -> None:
        """The steps' static buffers and their host twins. A budget's tree (ids, depths, mask) is one byte buffer
        (int64, int64, bool views), so that the host uploads it with one copy."""
        b, device, dtype = self.block, self.device, self.target.dtype
        self.draft_logits = torch.zeros(b - 1, vocab, device=device, dtype=dtype)
        self.widths = {n: min(n, vocab) for n in self.budgets}
        # log-probs and token ids in float64 (both exact there): one buffer, one read
        self.top = {n: torch.zeros(2, b - 1, self.widths[n], device=device, dtype=torch.float64) for n in self.budgets}
        self.tree_bytes = {n: tree_buffer(n, device) for n in self.budgets}
        self.tree_ids = {n: tree_views(self.tree_bytes[n], n)[0] for n in self.budgets}
        self.depths = {n: tree_views(self.tree_bytes[n], n)[1] for n in self.budgets}
        self.masks = {n: tree_views(self.tree_bytes[n], n)[2] for n in self.budgets}
        for mask in self.masks.values():
            mask.copy_(torch.eye(mask.shape[0], dtype=torch.bool))
        self.tree_logits = {n: torch.zeros(n + 1, vocab, device=device, dtype=dtype) for n in self.budgets}
        self.tree_argmax = {n: torch.zeros(n + 1, device=device, dtype=torch.long) for n in self.budgets}
        width = self.features[b].shape[1]
        self.tree_features = {n: torch.zeros(n + 1, width, device=device, dtype=dtype) for n in self.budgets}
        # the walk: its path (node indices, root first, padded with 0 to the block), its length, the token the
        # bonus excludes (-1: none)
        self.walk = torch.zeros(b + 2, device=device, dtype=torch.long)
        self.top_host = {n: host_buffer(t) for n, t in self.top.items()}
        self.tree_host = {n: host_buffer(t) for n, t in self.tree_bytes.items()}
        self.argmax_host = {n: host_buffer(t) for n, t in self.tree_argmax.items()}
        self.walk_host = host_buffer(self.walk)

    def _reset_walk(self) -> None:
        """A valid walk (the root alone, no exclusion) at start 0: what the accept step's capture runs."""
        self.start.zero_()
        self.walk.zero_()
        self.walk[self.block] = 1
        self.walk[self.block + 1] = -1

    def _tree_draft(self, n: int) -> None:
        b = self.block
        self.draft_logits.copy_(
            self.drafter.draft_logits(self.features[b], self.ctx_start, self.ids[b][0, :1], self.start, b)
        )
        draft_top(self.draft_logits, self.top[n])

    def _tree_verify(self, n: int) -> None:
        self.tree_ids[n][0, :1].copy_(self.ids[self.block][0, :1])  # the root: the bonus the last accept left
        logits, features = self.target.forward(
            self.tree_ids[n], self.start, features=True, tree=(self.depths[n], self.masks[n])
        )
        self.tree_logits[n].copy_(logits)
        self.tree_features[n].copy_(features)
        self.tree_argmax[n].copy_(logits.argmax(-1))

    def _tree_accept(self, n: int) -> None:
        """The walk applied with fixed shapes: pads past the path's length copy a slot onto itself, zero a
        feature row, write the bonus past the path (later steps overwrite it)."""
        b, start = self.block, self.start
        path, length, excluded = self.walk[:b], self.walk[b : b + 1], self.walk[b + 1 : b + 2]
        offsets = torch.arange(b, device=self.device)
        on_path = offsets < length
        row = self.tree_logits[n].index_select(0, path.index_select(0, (length - 1).clamp(min=0)))[0].float()
        vocab = torch.arange(row.shape[0], device=self.device)
        bonus = row.masked_fill(vocab == excluded, float("-inf")).argmax(-1).view(1)
        self.target.move_slots(torch.where(on_path, start + path, start + offsets), start + offsets)
        rows = self.tree_features[n].index_select(0, path)
        self.features[b].copy_(rows.masked_fill(~on_path[:, None], 0.0))
        tokens = self.tree_ids[n][0].index_select(0, path)
        values = torch.where(offsets + 1 < length, torch.cat([tokens[1:], bonus]), bonus)
        self.out.index_copy_(0, start + 1 + offsets, values)
        self.ctx_start.copy_(start)
        self.start.add_(length)
        self.ids[b][0, :1].copy_(bonus)

    @torch.inference_mode()
    def generate_tree(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        budget: int,
        simulate_tau: float | None = None,
        seed: int = 0,
        breakdown: bool = False,
    ) -> TreeRun:
        """Greedy generation of `max_new_tokens` tokens with DDTree-`budget` (acceptance simulated at
        `simulate_tau` when given). `breakdown`: synchronise after each phase and clock it (TreeRun.phases_s);
        the extra syncs cost time, so a run timed for its speedup leaves it off."""
        if budget not in self.budgets:
            raise ValueError(f"budget {budget} was not captured (budgets {self.budgets})")
        b = self.block
        n = self.prefill(prompt, b)
        max_length = n + int(max_new_tokens)
        if max_length + 1 > self.max_len:
            raise ValueError(f"{n} + {max_new_tokens} tokens do not fit a loop of max_len {self.max_len}")
        rng = random.Random(seed)
        lengths: list[int] = []
        build_s = walk_s = 0.0
        start = n
        self._sync()
        phases = _Phases(self._sync if breakdown else None)
        began = phases.last = time.perf_counter()
        while start + 1 < max_length:
            forced = simulated_length(simulate_tau, b, rng) if simulate_tau is not None else None
            self.tree_draft[budget]()
            if self.trace is not None:
                self.trace.append(self.draft_logits.clone())
            top = self.top_host[budget].copy_(self.top[budget]).numpy()  # the step's one read of the draft
            phases.lap("draft")
            clock = time.perf_counter()
            parents, node_tokens = self._upload_tree(top, budget, simulate_tau is not None)
            build_s += time.perf_counter() - clock
            phases.lap("build")
            self.tree_verify[budget]()
            argmax = None if forced is not None else self.argmax_host[budget].copy_(self.tree_argmax[budget])
            phases.lap("verify")
            clock = time.perf_counter()
            path, excluded = _walk(parents, node_tokens, None if argmax is None else argmax.numpy(), forced)
            walk_s += time.perf_counter() - clock
            phases.lap("walk")
            self._upload_walk(path, excluded)
            self.tree_accept[budget]()
            phases.lap("accept")
            lengths.append(min(len(path), max_length - start - 1))
            start += len(path)
        self._sync()
        decode_s = time.perf_counter() - began
        output = self.out[:max_length].clone().cpu()[None]
        return TreeRun(
            decode_s, 1 + sum(lengths), lengths, output, build_s, walk_s, phases.seconds if breakdown else None
        )

    def _upload_tree(self, top: np.ndarray, budget: int, spine: bool) -> tuple[list[int], list[int]]:
        """Build the tree from the read top-k and upload its ids, depths and mask with one copy (from a pinned
        buffer: asynchronous; the host writes the buffer again only after the next step's read)."""
        parents, node_tokens = fill_tree(top, budget, self.tree_host[budget], spine)
        self.tree_bytes[budget].copy_(self.tree_host[budget], non_blocking=True)
        return parents, node_tokens

    def _upload_walk(self, path: list[int], excluded: int) -> None:
        """The path (padded to the block), its length and the bonus's excluded token: one small copy."""
        walk = self.walk_host.numpy()
        walk[:] = 0
        walk[: len(path)] = path
        walk[self.block], walk[self.block + 1] = len(path), excluded
        self.walk.copy_(self.walk_host, non_blocking=True)


def _walk(
    parents: list[int], node_tokens: list[int], argmax: np.ndarray | None, forced: int | None
) -> tuple[list[int], int]:
    """The accepted path (node indices, root first) and the token its bonus excludes (-1: none). Greedy
    (`argmax`, the target's per node): from the root, the child whose token is its parent's argmax; the bonus
    is the last node's argmax. Simulated (`forced` = k): the best child, k - 1 times or until a leaf; the bonus
    is the last node's argmax without the token of the child the path would take next."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, []).append(node)  # in pop order: best-scoring child first
    path = [0]
    if forced is None:
        while True:
            match = [c for c in children.get(path[-1], []) if node_tokens[c] == argmax[path[-1]]]
            if not match:
                return path, -1
            path.append(match[0])
    while len(path) < forced and children.get(path[-1]):
        path.append(children[path[-1]][0])
    following = children.get(path[-1])
    return path, node_tokens[following[0]] if following else -1
