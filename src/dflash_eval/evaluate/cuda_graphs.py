"""CUDA graphs of the packed drafter forward, for the late, small rounds.

A late round of the trajectory evaluator computes few blocks, and on the H200 its forward is bound by the
kernel launches the host issues (benchmarks/results/round_profile.md: rounds of <= 256 blocks ran at 1-25% of
the bf16 peak). A CUDA graph replays a captured forward's kernels with one launch, but only at the shapes it was
captured with and reading its inputs from the addresses it was captured with. So a round whose flat tokens fit
one of the captured sizes is packed to fixed shapes (packed.Padding: that many tokens, one query group per pool
slot, queries per group rounded up to a power of two, the context at the pool's capacity), its index arrays are
copied into the graph's own, the graph replays, and the output is sliced to the real tokens. Padding changes no
real output (pack_arrays says why), only the arithmetic's shapes: on a GPU a GEMM over more rows or a softmax over
more (hidden) keys may round differently, so the graphs are an option, off by default, and measured.

Rounds above the largest captured size, drafters with DFlash2's block convolution (its row layout has no fixed
shape) run eagerly. The head and the scorer after the forward are not captured: their shapes
follow the round's outcome (how many blocks matched past the head split, which blocks are of full size).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_eval.evaluate import packed
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.packed import (
    FIXED_FIELDS,
    ContextPool,
    PackedBlocks,
    Padding,
    pack_arrays,
)
from dflash_eval.evaluate.transfer import to_device

# evaluation.cuda_graphs (the schema's key): the TrajectoryEvaluator options of each route. "padded": graphs at a few
# size classes (rounds padded up to them); "round_tokens": a graph per round's own flat token count, at most 64.
ROUTES: dict[str, dict] = {
    "none": {},
    "padded": {"cuda_graph_tokens": [512, 1024, 2048, 4096]},
    "round_tokens": {"cuda_graph_tokens": [4096], "graph_exact_tokens": True, "max_graphs": 64},
}
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
MIN_QUERIES = 16  # queries per group are padded to a power of two, at least this (fewer graphs)


def cuda_capture(pool) -> Capture:
    """Captures a forward as a CUDA graph in the memory `pool` (shared by every graph of an evaluator: they
    replay one at a time); returns its replay, which gives the graph's own output tensor."""

    def capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy initialisation, cuBLAS workspaces)
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def graph_options(route: str | None, device: torch.device, drafter: BlockDrafter) -> dict:
    """The evaluator's options for evaluation.cuda_graphs `route`: none off CUDA (a graph is a CUDA feature; the
    CPU's stand-in would only add copies) and for drafters whose shapes vary per round (GraphedForward.supports)."""
    if route not in ROUTES:
        raise ValueError(f"evaluation.cuda_graphs: {route!r} is not one of {sorted(ROUTES)}")
    if device.type != "cuda" or not GraphedForward.supports(drafter):
        return {}
    return dict(ROUTES[route])


def eager_capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A stand-in for a graph that runs the forward eagerly on the fixed inputs at each replay: on a CPU it tests
    the padding and the inputs' copies, everything a graph replay adds but the replay itself."""
    return forward


@dataclass
class Captured:
    inputs: torch.Tensor  # the FIXED_FIELDS, flat, in order: what each replay's copy overwrites
    replay: Callable[[], torch.Tensor]


def queries_bucket(queries: int) -> int:
    return max(MIN_QUERIES, 1 << max(int(queries) - 1, 0).bit_length())


class GraphedForward:
    """packed_hidden for rounds of at most max(`token_sizes`) flat tokens, from graphs captured on first use, one
    per (token size, queries per group, attention kind); `capture` makes one (cuda_capture on CUDA)."""

    def __init__(
        self,
        drafter: BlockDrafter,
        pool: ContextPool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        token_sizes: Sequence[int],
        capture: Capture,
        exact_tokens: bool = False,
        max_graphs: int | None = None,
    ) -> None:
        self.drafter, self.pool, self.cos, self.sin = drafter, pool, cos, sin
        self.sizes = sorted({int(s) for s in token_sizes})
        # exact_tokens: a graph per round's own flat token count (up to max(token_sizes)), so that every GEMM runs
        # over the eager forward's rows (the same kernels, the same rounding); only the attention's groups, queries
        # and context are padded. max_graphs: past that many graphs a new shape runs eagerly.
        self.exact_tokens, self.max_graphs = exact_tokens, max_graphs
        self.capture = capture
        self.graphs: dict[tuple[int, int, bool], Captured] = {}
        self.slots = pool.keys[0].shape[0]
        self.device = pool.keys[0].device
        self.replays = 0
        self.capture_seconds = 0.0  # synchronised wall time spent capturing (warm-ups included)

    @staticmethod
    def supports(drafter: BlockDrafter) -> bool:
        """False for DFlash2's block convolution (its [blocks, longest] row layout varies per round)."""
        return not any(
            getattr(layer, name, None) is not None
            for layer in drafter.drafter.layers
            for name in ("attention_conv", "mlp_conv")
        )

    def padding(self, size: np.ndarray, slot: np.ndarray) -> Padding | None:
        """The fixed shapes for this round's blocks, or None when no captured size holds its tokens."""
        tokens = int(size.sum())
        if self.exact_tokens:
            fits = tokens if tokens <= self.sizes[-1] else None
        else:
            fits = next((s for s in self.sizes if s >= tokens), None)
        if fits is None:
            return None
        queries = int(np.bincount(slot, weights=size, minlength=self.slots).max())
        return Padding(fits, queries_bucket(queries), self.slots, self.pool.capacity)

    def __call__(
        self, slot: np.ndarray, anchor: np.ndarray, size: np.ndarray, tokens: np.ndarray, fused: bool
    ) -> torch.Tensor | None:
        """Hidden states [N, H] of the blocks (as packed_hidden), or None: run this round eagerly."""
        padding = self.padding(size, slot)
        if padding is None:
            return None
        arrays, _ = pack_arrays(slot, anchor, size, tokens, self.drafter.mask_token_id, "slot", padding)
        # The eager path's choice of attention, from the real queries (the padded ones are more)
        fused = fused and int(np.bincount(slot, weights=size).max()) >= packed.FUSED_MIN_QUERIES
        key = (padding.tokens, padding.queries, fused)
        if key not in self.graphs and self.max_graphs is not None and len(self.graphs) >= self.max_graphs:
            return None
        if key not in self.graphs:
            started = self._clock()
            self.graphs[key] = self._capture(padding, fused)
            self.capture_seconds += self._clock() - started
        captured = self.graphs[key]
        flat = np.concatenate([arrays[name].reshape(-1) for name in FIXED_FIELDS])
        captured.inputs.copy_(to_device([flat], self.device)[0], non_blocking=True)
        self.replays += 1
        return captured.replay()[: int(size.sum())]

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _capture(self, padding: Padding, fused: bool) -> Captured:
        shapes = {
            "token_ids": (padding.tokens,),
            "positions": (padding.tokens,),
            "query_gather": (padding.slots, padding.queries),
            "padded_index": (padding.tokens,),
            "query_anchor": (padding.slots, padding.queries),
            "query_pos": (padding.slots, padding.queries),
            "query_row": (padding.slots, padding.queries),
        }
        sizes = [int(np.prod(shapes[name])) for name in FIXED_FIELDS]
        inputs = torch.zeros(sum(sizes), dtype=torch.int64, device=self.device)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        views = {
            name: inputs[lo:hi].view(shapes[name]) for name, lo, hi in zip(FIXED_FIELDS, offsets[:-1], offsets[1:])
        }
        views["query_row"].fill_(-1)  # the warm-up's inputs: all padding
        unused = torch.zeros(1, 1, dtype=torch.int64, device=self.device)  # the convolution's layout (none here)
        batch = PackedBlocks(
            **views,
            row_index=unused,
            row_flat=unused[0],
            slots=slice(0, padding.slots),
            ctx_len=padding.context,
            group_ctx=np.full(padding.slots, padding.context),
            group_queries=np.full(padding.slots, padding.queries),
        )
        drafter, pool, cos, sin = self.drafter, self.pool, self.cos, self.sin
        return Captured(inputs, self.capture(lambda: packed.packed_hidden(drafter, pool, batch, cos, sin, fused)))
