"""Trajectory-following evaluation: the drafter's block only where the reference loop drafts one.

How, in detail: docs/internals.md (`evaluate/trajectory.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_eval.config import setting_default
from dflash_eval.evaluate.acceptance import SequenceLimits
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.cuda_graphs import (
    Capture,
    GraphedForward,
    cuda_capture,
    eager_capture,
)
from dflash_eval.evaluate.ddtree import tree_accepted
from dflash_eval.evaluate.packed import (
    ContextPool,
    fused_attention_for,
    pack,
    packed_hidden,
)
from dflash_eval.evaluate.transfer import to_device
from dflash_eval.methods import chain_method, tree_method

UNKNOWN = -1


@dataclass
class LoadedSample:
    """A sample's cached features [T, n_layers * H] (drafter dtype) and tokens [T], on the drafter's device."""

    features: torch.Tensor
    tokens: torch.Tensor
    limits: SequenceLimits


@dataclass
class SampleSpec:
    """One sample to evaluate: its length T, and `load`, called only when the sample enters the pool."""

    key: str
    length: int
    load: Callable[[], LoadedSample]


@dataclass
class TrajectoryResult:
    """Tokens produced per verification step for every method, and top-k counts on chain-B's blocks."""

    steps: dict[str, list[int]]
    topk_hits: np.ndarray  # [B - 1, len(topk)]
    topk_seen: np.ndarray  # [B - 1]


@dataclass
class Counts:
    """What an evaluation computed: drafter blocks, forwards, rounds, LM head positions skipped, CUDA graphs."""

    blocks: int = 0
    forwards: int = 0
    rounds: int = 0
    head_positions_skipped: int = 0  # LM head positions a chain block never scored (past its first mismatch)
    all_anchor_blocks: int = 0  # what all_anchor.py computes for the same samples and methods
    by_size: dict[int, int] = field(default_factory=dict)  # distinct blocks computed, by length
    graphs: int = 0  # CUDA graphs captured (cuda_graph_tokens)
    graph_replays: int = 0  # forwards that replayed one
    graph_capture_seconds: float = 0.0


@dataclass(frozen=True)
class EvaluatorOptions:
    """How the evaluator computes, never what: every choice gives the same steps (in fp32; tests/evaluate).

    A forward holds at most `blocks_per_forward` blocks; the pool at most `blocks_per_forward` samples, or
    `pool_slots`, fewer when their contexts would take more than `pool_bytes` (None: half the free GPU memory, 2 GiB
    on CPU). `head_split`: a chain-only block's LM head runs on its first positions, the rest only where those all
    matched. `attention_groups`: "slot" (a query group per pool slot) or "row" (per block). `fused_attention`: None
    picks by device (packed.fused_attention_for). `cuda_graph_tokens`: forwards of at most max(these) flat tokens
    replay a CUDA graph captured at the smallest of these sizes that holds them (cuda_graphs.py; `graph_capture`
    None: a real graph on CUDA, the eager stand-in elsewhere; not with "row" groups or DFlash2's convolution);
    `graph_exact_tokens`: a graph per forward's own flat token count instead, `max_graphs`: at most that many graphs,
    later new shapes run eagerly. The stage sets `blocks_per_forward` and the graph route (evaluation.cuda_graphs,
    cuda_graphs.graph_options); the rest are the defaults here (blocks_per_forward's is the schema's).
    """

    blocks_per_forward: int = field(default_factory=lambda: setting_default("evaluation", "blocks_per_forward"))
    pool_slots: int | None = None
    pool_bytes: int | None = None
    head_split: int | None = 4
    attention_groups: str = "slot"
    fused_attention: bool | None = None
    cuda_graph_tokens: Sequence[int] = ()
    graph_capture: Capture | None = None
    graph_exact_tokens: bool = False
    max_graphs: int | None = None


def all_anchor_blocks(limits: SequenceLimits, block_sizes: Sequence[int], block: int) -> int:
    """Blocks the all-anchor evaluator computes for one sample: every anchor, every chain size (B serves trees)."""
    anchors = np.arange(limits.prompt_len, limits.total_len - 1)
    return int(sum((np.minimum(b, limits.max_length - anchors) > 1).sum() for b in sorted(set(block_sizes) | {block})))


class TrajectoryEvaluator:
    """Evaluates chain methods of `block_sizes` (plus the drafter's own B), DDTree `budgets` and top-k, computed as
    `options` say (EvaluatorOptions)."""

    def __init__(
        self,
        drafter: BlockDrafter,
        stop_ids: set[int],
        block_sizes: Sequence[int] = (),
        budgets: Sequence[int] = (),
        topk: Sequence[int] = (),
        options: EvaluatorOptions = EvaluatorOptions(),  # noqa: B008 (frozen: one shared default is safe)
    ) -> None:
        self.drafter = drafter
        self.stop_ids = set(stop_ids)
        self.block = drafter.block_size
        sizes = sorted(set(block_sizes) | {self.block})
        if min(sizes) < 2 or max(sizes) > self.block:
            raise ValueError(f"chain block sizes must lie in 2..{self.block}, got {sizes}")
        self.budgets = list(budgets)
        self.topk = list(topk)
        # Method order = the all-anchor evaluator's steps order: chains by size, then trees as given.
        self.names = [chain_method(b) for b in sizes] + [tree_method(n) for n in self.budgets]
        self.method_block = np.array(sizes + [self.block] * len(self.budgets), dtype=np.int64)
        self.method_tree = np.array([-1] * len(sizes) + list(range(len(self.budgets))), dtype=np.int64)
        self.primary = sizes.index(self.block)
        self.options = options
        self.blocks_per_forward = max(1, int(options.blocks_per_forward))
        self.head_split = options.head_split
        self.sizes = sizes
        self.counts = Counts()
        self.device = drafter.embed.device
        self.dtype = drafter.embed.dtype
        self.fused = fused_attention_for(self.device) if options.fused_attention is None else options.fused_attention
        self.graph_tokens = list(options.cuda_graph_tokens)
        if self.graph_tokens and (options.attention_groups != "slot" or not GraphedForward.supports(drafter)):
            raise ValueError(
                "cuda_graph_tokens: not with 'row' attention groups or a drafter with DFlash2's block convolution "
                "(their shapes vary per round)"
            )
        self.graphed: GraphedForward | None = None

    # -- the pool ------------------------------------------------------------------------------
    def _slots(self, samples: Sequence[SampleSpec], capacity: int) -> int:
        wanted = self.options.pool_slots or min(len(samples), self.blocks_per_forward)
        budget = self.options.pool_bytes
        if budget is None:
            budget = int(0.5 * torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else 2 << 30
        fits = budget // max(ContextPool.bytes_per_slot(self.drafter, capacity, self.dtype), 1)
        return max(1, min(wanted, len(samples), int(fits)))

    def _allocate(self, slots: int, capacity: int) -> None:
        width = capacity + self.block + 1
        self.pool = ContextPool(self.drafter, slots, capacity, self.device, self.dtype)
        cos, sin = self.drafter.rotary(width, self.pool.keys[0])
        self.cos, self.sin = cos, sin
        if self.graph_tokens:
            options = self.options
            capture = options.graph_capture or (
                cuda_capture(torch.cuda.graph_pool_handle()) if self.device.type == "cuda" else eager_capture
            )
            self.graphed = GraphedForward(
                self.drafter,
                self.pool,
                cos,
                sin,
                self.graph_tokens,
                capture,
                options.graph_exact_tokens,
                options.max_graphs,
            )
        methods = len(self.names)
        self.keys: list[str | None] = [None] * slots
        self.tokens = np.full((slots, width), -1, dtype=np.int64)  # -1 past a sample's end: no true token
        self.next_stop = np.zeros((slots, width), dtype=np.int64)  # first stop position >= t
        self.total_len = np.zeros(slots, dtype=np.int64)
        self.max_len = np.zeros(slots, dtype=np.int64)
        self.start = np.zeros((slots, methods), dtype=np.int64)
        self.done = np.ones((slots, methods), dtype=bool)
        self.steps: list[list[list[int]]] = [[[] for _ in range(methods)] for _ in range(slots)]
        # What each block computed so far gave: matched chain length by (anchor, size), tree depth per budget
        # and top-k hits per position for the blocks of full size.
        self.matched = np.full((slots, capacity, self.block + 1), UNKNOWN, dtype=np.int16)
        self.tree = np.zeros((slots, capacity, max(len(self.budgets), 1)), dtype=np.int16)
        self.topk_hit = np.zeros((slots, capacity, self.block - 1, max(len(self.topk), 1)), dtype=bool)
        self.hits = np.zeros((slots, self.block - 1, len(self.topk)), dtype=np.int64)
        self.seen = np.zeros((slots, self.block - 1), dtype=np.int64)

    def _admit(self, slot: int, spec: SampleSpec) -> bool:
        """Load a sample into `slot`; False when it needs no step at all (it then is finished already)."""
        loaded = spec.load()
        limits, features = loaded.limits, loaded.features
        host = loaded.tokens.cpu().numpy().astype(np.int64)
        if not len(host) == limits.total_len == spec.length:
            raise ValueError(
                f"sample {spec.key}: {len(host)} tokens, its limits say {limits.total_len} and its spec {spec.length}"
            )
        self.counts.all_anchor_blocks += all_anchor_blocks(limits, self.sizes, self.block)
        self.keys[slot] = spec.key
        self.tokens[slot] = -1
        self.tokens[slot, : len(host)] = host
        is_stop = (
            np.isin(self.tokens[slot], list(self.stop_ids)) if self.stop_ids else np.zeros(self.tokens.shape[1], bool)
        )
        sentinel = self.tokens.shape[1] + 1
        stops = np.where(is_stop, np.arange(len(is_stop)), sentinel)
        self.next_stop[slot] = np.minimum.accumulate(stops[::-1])[::-1]
        self.total_len[slot], self.max_len[slot] = limits.total_len, limits.max_length
        first = limits.prompt_len
        stopped = bool(is_stop[first]) if first < limits.total_len else True
        self.start[slot] = first
        self.done[slot] = stopped or first + 1 >= limits.max_length
        self.steps[slot] = [[] for _ in self.names]
        self.matched[slot] = UNKNOWN
        self.hits[slot], self.seen[slot] = 0, 0
        if self.done[slot].all():
            return False
        self.pool.write(slot, self.drafter, features)
        return True

    def _result(self, slot: int) -> TrajectoryResult:
        return TrajectoryResult(
            steps=dict(zip(self.names, self.steps[slot])),
            topk_hits=self.hits[slot].copy(),
            topk_seen=self.seen[slot].copy(),
        )

    # -- one round -----------------------------------------------------------------------------
    def _round(self) -> None:
        slot, method = np.nonzero(~self.done)
        start = self.start[slot, method]
        past = start + 1 >= self.total_len[slot]
        if past.any():
            where = int(np.argmax(past))
            raise ValueError(
                f"sample {self.keys[slot[where]]}: offline trajectory ran past the completion at "
                f"position {start[where]}"
            )
        size = np.minimum(self.method_block[method], self.max_len[slot] - start)
        wanted = self.matched[slot, start, size] == UNKNOWN
        width, capacity = self.block + 1, self.matched.shape[1]
        if wanted.any():
            code = np.unique((slot[wanted] * capacity + start[wanted]) * width + size[wanted])
            self._compute(code // width // capacity, code // width % capacity, code % width)
        tree = self.method_tree[method]
        accepted = np.where(tree >= 0, self.tree[slot, start, np.maximum(tree, 0)], self.matched[slot, start, size])
        accepted = accepted.astype(np.int64)
        if self.topk:
            own = method == self.primary
            s, a, width = slot[own], start[own], size[own] - 1
            inside = np.minimum(width, self.total_len[s] - a - 1)
            self.seen[s] += np.arange(self.block - 1)[None] < inside[:, None]
            self.hits[s] += self.topk_hit[s, a, :, : len(self.topk)]
        produced = np.minimum(accepted + 1, self.max_len[slot] - start - 1)
        stop = self.next_stop[slot, start + 1]
        stopped = stop <= start + produced
        produced = np.where(stopped, stop - start, produced)
        after = start + produced
        self.start[slot, method] = after
        self.done[slot, method] = stopped | (after + 1 >= self.max_len[slot])
        for s, m, p in zip(slot.tolist(), method.tolist(), produced.tolist()):
            self.steps[s][m].append(p)
        self.counts.rounds += 1

    def _compute(self, slot: np.ndarray, anchor: np.ndarray, size: np.ndarray) -> None:
        """Run the blocks (slot, anchor, size), sorted by slot, and record their outcomes."""
        full = size == np.minimum(self.block, self.max_len[slot] - anchor)
        for lo in range(0, len(slot), self.blocks_per_forward):
            part = slice(lo, lo + self.blocks_per_forward)
            self._forward(slot[part], anchor[part], size[part], full[part])

    def _forward(self, slot: np.ndarray, anchor: np.ndarray, size: np.ndarray, full: np.ndarray) -> None:
        drafter, device = self.drafter, self.device
        hidden = None if self.graphed is None else self.graphed(slot, anchor, size, self.tokens, self.fused)
        if hidden is None:
            batch = pack(slot, anchor, size, self.tokens, drafter.mask_token_id, device, self.options.attention_groups)
            hidden = packed_hidden(drafter, self.pool, batch, self.cos, self.sin, self.fused)
        else:
            self.counts.graph_replays += 1
            self.counts.graphs = len(self.graphed.graphs)
            self.counts.graph_capture_seconds = self.graphed.capture_seconds
        row_start = np.concatenate([[0], np.cumsum(size)[:-1]])
        # One table of outcomes per forward, read back once: matched, tree depths, top-k hits per position.
        wide_rows = full & bool(self.budgets or self.topk)  # full blocks serve trees and top-k when there are any
        budgets, ks, width = len(self.budgets), len(self.topk), self.block - 1
        order, tables = [], []
        flat = getattr(drafter.drafter, "candidate_selector", None) is None  # argmax drafts: per position
        if flat and not wide_rows.all():
            rows = np.nonzero(~wide_rows)[0]
            table = torch.zeros(len(rows), 1 + budgets + width * ks, dtype=torch.int64, device=device)
            table[:, 0] = self._chain_flat(hidden, slot[rows], anchor[rows], size[rows], row_start[rows])
            order.append(rows)
            tables.append(table)
        for block in np.unique(size).tolist():
            for wide in (True, False):
                if flat and not wide:
                    continue
                rows = np.nonzero((size == block) & (wide_rows == wide))[0]
                if len(rows) == 0:
                    continue
                positions = anchor[rows][:, None] + 1 + np.arange(block - 1)[None]
                index, truth, first = to_device(
                    [
                        row_start[rows][:, None] + np.arange(block)[None],
                        self.tokens[slot[rows][:, None], positions],
                        self.tokens[slot[rows], anchor[rows]],
                    ],
                    device,
                )
                states = hidden[index]  # [m, block, H]
                table = torch.zeros(len(rows), 1 + budgets + width * ks, dtype=torch.int64, device=device)
                if wide:
                    matched, depths, hit = self._full(states, truth, first)
                    if depths is not None:
                        table[:, 1 : 1 + budgets] = depths.T
                    if hit is not None:  # positions past a shortened block stay misses
                        padded = torch.zeros(len(rows), width, ks, dtype=torch.int64, device=device)
                        padded[:, : block - 1] = hit
                        table[:, 1 + budgets :] = padded.reshape(len(rows), -1)
                else:
                    matched = self._chain(states, truth, first)
                table[:, 0] = matched
                order.append(rows)
                tables.append(table)
        rows = np.concatenate(order)
        table = torch.cat(tables).cpu().numpy()
        s, a = slot[rows], anchor[rows]
        self.matched[s, a, size[rows]] = table[:, 0]
        wide = wide_rows[rows]
        if budgets:
            self.tree[s[wide], a[wide], :budgets] = table[wide, 1 : 1 + budgets]
        if ks:
            self.topk_hit[s[wide], a[wide], :, :ks] = table[wide, 1 + budgets :].reshape(-1, width, ks).astype(bool)
        self.counts.forwards += 1
        self.counts.blocks += len(slot)
        for block in size.tolist():
            self.counts.by_size[block] = self.counts.by_size.get(block, 0) + 1

    def _full(self, states: torch.Tensor, truth: torch.Tensor, first: torch.Tensor):
        """Blocks of full size: the chain match, DDTree depths and top-k hits from all positions' logits."""
        logits = self.drafter.logits(states)
        draft = self.drafter.draft_tokens(states, logits, first)
        matched = (draft == truth).to(torch.int64).cumprod(dim=1).sum(dim=1)
        # the DDTree scorer without host reads: faster on CUDA, not slower on the CPU (evaluator_speed.md)
        depths = tree_accepted(logits, truth, self.budgets, host_reads=False) if self.budgets else None
        hit = None
        if self.topk:  # the truth is in the top k iff fewer than k logits beat it (one pass, not a top-k)
            score = logits.gather(-1, truth.clamp(min=0)[..., None])
            # Counted as bytes into int32: a bool sum first copies every flag to int64, which is slower
            # (benchmarks/results/score_ops.md).
            rank = (logits > score).view(torch.uint8).sum(dim=-1, dtype=torch.int32)
            hit = (rank[..., None] < torch.tensor(self.topk, device=rank.device)) & (truth >= 0)[..., None]
        return matched, depths, hit

    def _chain_flat(
        self, hidden: torch.Tensor, slot: np.ndarray, anchor: np.ndarray, size: np.ndarray, row_start: np.ndarray
    ) -> torch.Tensor:
        """Matched draft length of chain-only blocks of any sizes at once, for argmax drafts: the LM head runs on
        the draft positions themselves (no padding), the first `head_split` of every block, then the rest only
        for the blocks that matched all of those (chosen on the device: one wait for the GPU, for their count)."""
        rows = len(slot)
        positions = size - 1
        row = np.repeat(np.arange(rows), positions)
        offset = np.arange(len(row)) - np.repeat(np.cumsum(positions) - positions, positions)
        split = self.head_split or int(positions.max())
        first = offset < split
        order = np.concatenate([np.nonzero(first)[0], np.nonzero(~first)[0]])  # the first stage's positions first
        leading = int(first.sum())
        row, offset = row[order], offset[order]
        flat, row, offset, truth = to_device(
            [row_start[row] + 1 + offset, row, offset, self.tokens[slot[row], anchor[row] + 1 + offset]], self.device
        )
        hits = torch.zeros(rows, int(positions.max()), dtype=torch.int64, device=self.device)

        def score(where: slice | torch.Tensor) -> None:
            draft = self.drafter.head_logits(hidden[flat[where]]).argmax(dim=-1)
            hits[row[where], offset[where]] = (draft == truth[where]).to(torch.int64)

        score(slice(0, leading))
        matched = hits.cumprod(dim=1).sum(dim=1)
        # A block with no position past the split has none here, whatever it matched.
        rest = torch.nonzero(matched[row[leading:]] == split)[:, 0] + leading
        self.counts.head_positions_skipped += len(order) - leading - len(rest)
        if len(rest) == 0:
            return matched
        score(rest)
        return hits.cumprod(dim=1).sum(dim=1)

    def _chain(self, states: torch.Tensor, truth: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Matched draft length of chain-only blocks; positions after the first mismatch are not read."""
        positions = states.shape[1] - 1
        split = self.head_split
        if not split or positions <= split:
            logits = self.drafter.logits(states)
            draft = self.drafter.draft_tokens(states, logits, first)
            return (draft == truth).to(torch.int64).cumprod(dim=1).sum(dim=1)
        head = self.drafter.logits(states[:, : split + 1])
        draft = self.drafter.draft_tokens(states[:, : split + 1], head, first)
        matched = (draft == truth[:, :split]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        alive = torch.nonzero(matched == split)[:, 0]
        rows = states.shape[0]
        kept = int(alive.numel())
        self.counts.head_positions_skipped += (rows - kept) * (positions - split)
        if kept == 0:
            return matched
        tail = self.drafter.logits(states[alive, split:])
        if getattr(self.drafter.drafter, "candidate_selector", None) is None:
            rest = (tail.argmax(dim=-1) == truth[alive, split:]).to(torch.int64).cumprod(dim=1).sum(dim=1)
            return matched.index_add(0, alive, rest)
        draft = self.drafter.draft_tokens(states[alive], torch.cat([head[alive], tail], dim=1), first[alive])
        whole = (draft == truth[alive]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return matched.index_copy(0, alive, whole)

    # -- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, samples: Sequence[SampleSpec]) -> Iterator[tuple[str, TrajectoryResult]]:
        """Yields (key, result) as samples finish, in no fixed order."""
        if not samples:
            return
        capacity = max(spec.length for spec in samples)
        self._allocate(self._slots(samples, capacity), capacity)
        # Longest first: samples of similar lengths share forwards, so less attention is spent on padding.
        queue = sorted(samples, key=lambda spec: -spec.length)
        queue.reverse()
        free = list(range(len(self.keys)))[::-1]
        resident = 0
        while queue or resident:
            while free and queue:
                spec = queue.pop()
                slot = free.pop()
                if self._admit(slot, spec):
                    resident += 1
                else:
                    yield spec.key, self._result(slot)
                    self.keys[slot] = None
                    free.append(slot)
            if not resident:
                continue
            self._round()
            finished = np.nonzero(self.done.all(axis=1) & np.array([k is not None for k in self.keys]))[0]
            for slot in finished.tolist():
                yield self.keys[slot], self._result(slot)
                self.keys[slot] = None
                free.append(slot)
                resident -= 1
