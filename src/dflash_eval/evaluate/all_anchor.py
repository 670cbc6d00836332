"""The all-anchor reference evaluator: one sample's drafts at every anchor, then the trajectories on them.

The evaluate stage runs the trajectory evaluator (trajectory.py), which drafts only the blocks the reference
loops visit; this one drafts every anchor, is simpler, and is the reference the tests hold it to.

For every anchor s of the completion we compute the drafter's block exactly as the reference loop
would run it there (block [x_s, mask...], shortened near the token budget), and from its logits:
the matched draft length (chain), the deepest matching path of a DDTree of each budget, and top-k
hits per block position. A smaller chain block size b is its own pass with blocks of b tokens,
because full-attention drafter layers are non-causal inside the block: a block of b tokens drafts
differently from the first b - 1 positions of a block of B (this is `dflash_generate(block_size=b)`).
The trajectories then follow the reference loop from the first completion token.

For a DFlash2DraftModel the chain draft is its candidate selector's path (what `dflash_generate`
proposes); DDTree and top-k read the per-position logits, as for DFlash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_eval.evaluate.acceptance import (
    SequenceLimits,
    chain_steps,
    matched_prefix,
    verify_sizes,
)
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.ddtree import tree_accepted
from dflash_eval.methods import chain_method, tree_method


@dataclass
class AnchorOutcomes:
    """Per-anchor results for anchors prompt_len .. total_len - 2."""

    chain: dict[int, np.ndarray] = field(default_factory=dict)  # block size -> matched draft tokens
    tree: dict[int, np.ndarray] = field(default_factory=dict)  # budget -> matched tree depth
    topk_hits: np.ndarray | None = None  # [B - 1, len(topk)] true token within the top-k, per position
    topk_seen: np.ndarray | None = None  # [B - 1] anchors with a true token at that position


@dataclass
class SampleResult:
    """Per-anchor outcomes and the trajectory each method implies (tokens per verification step)."""

    outcomes: AnchorOutcomes
    steps: dict[str, list[int]]  # method name (methods.py: "chain-B8", "ddtree-32") -> produced tokens per step


def _truth(tokens: torch.Tensor, anchors: torch.Tensor, width: int) -> torch.Tensor:
    """True tokens after each anchor, [m, width], -1 past the end of the sequence."""
    positions = anchors[:, None] + 1 + torch.arange(width, device=anchors.device)[None]
    inside = positions < tokens.shape[0]
    return torch.where(inside, tokens[positions.clamp(max=tokens.shape[0] - 1)], torch.full_like(positions, -1))


@torch.inference_mode()
def anchor_outcomes(
    drafter: BlockDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    limits: SequenceLimits,
    block_sizes: Sequence[int] = (),
    budgets: Sequence[int] = (),
    topk: Sequence[int] = (),
    chunk: int = 128,
) -> AnchorOutcomes:
    """Drafts at every anchor for each chain block size; DDTree and top-k from the drafter's own size."""
    full = drafter.block_size
    sizes_wanted = sorted(set(block_sizes) | {full})
    n_anchors = max(0, limits.total_len - 1 - limits.prompt_len)
    out = AnchorOutcomes()
    out.topk_hits = np.zeros((full - 1, len(topk)), dtype=np.int64)
    out.topk_seen = np.zeros(full - 1, dtype=np.int64)
    for budget in budgets:
        out.tree[budget] = np.zeros(n_anchors, dtype=np.int64)
    if n_anchors == 0:
        out.chain = {b: np.zeros(0, dtype=np.int64) for b in sizes_wanted}
        return out
    context = drafter.context(features)
    for block in sizes_wanted:
        accepted = torch.zeros(n_anchors, dtype=torch.long, device=features.device)  # read once, at the end
        for drafted in anchor_blocks(drafter, context, tokens, limits, block, chunk):
            draft = drafter.draft_tokens(drafted.hidden, drafted.logits, tokens[drafted.anchors])
            accepted[drafted.where] = matched_prefix(draft, tokens, drafted.anchors)
            if block == full:
                _tree_and_topk(
                    out, drafted.logits, _truth(tokens, drafted.anchors, drafted.size - 1), drafted.part, budgets, topk
                )
        out.chain[block] = accepted.cpu().numpy()
    return out


@dataclass
class DraftedBlocks:
    """The drafter's blocks at some anchors: their indices from the first anchor, positions, states and logits."""

    part: np.ndarray  # anchor index - prompt_len, on the host
    where: torch.Tensor  # the same on the device
    anchors: torch.Tensor  # absolute positions
    size: int  # block length (the reference loop's verify size there)
    hidden: torch.Tensor  # [m, size, H]
    logits: torch.Tensor  # [m, size - 1, V]


def anchor_blocks(drafter: BlockDrafter, context, tokens: torch.Tensor, limits: SequenceLimits, block: int, chunk: int):
    """The block the reference loop drafts at every anchor for block size `block`, `chunk` anchors at a time.

    Near the token budget the block is shorter (verify_sizes), and a block of one token drafts nothing, so those
    anchors are left out. The rejection scheme's acceptance probabilities read the same blocks (evaluate.rejection).
    """
    anchors_all = torch.arange(limits.prompt_len, limits.total_len - 1, device=tokens.device)
    sizes = verify_sizes(limits, block)
    for size in np.unique(sizes):
        if size <= 1:
            continue  # a block of one token drafts nothing: the step yields only the bonus token
        index = np.nonzero(sizes == size)[0]
        for begin in range(0, len(index), chunk):
            part = index[begin : begin + chunk]
            where = torch.as_tensor(part, device=tokens.device)
            anchors = anchors_all[where]
            hidden = drafter.block_hidden(
                context, tokens, anchors, block_size=int(size), ctx_len=limits.prompt_len + int(part.max())
            )
            yield DraftedBlocks(part, where, anchors, int(size), hidden, drafter.logits(hidden))


def _tree_and_topk(
    out: AnchorOutcomes,
    logits: torch.Tensor,
    truth: torch.Tensor,
    part: np.ndarray,
    budgets: Sequence[int],
    topk: Sequence[int],
) -> None:
    if budgets:
        depths = tree_accepted(logits, truth, budgets).cpu().numpy()
        for row, budget in enumerate(budgets):
            out.tree[budget][part] = depths[row]
    if topk:
        width = logits.shape[1]
        ranked = torch.topk(logits, max(topk), dim=-1).indices  # [m, P, K]
        hit = ranked == truth[..., None]
        seen = (truth >= 0).sum(dim=0).cpu().numpy()
        out.topk_seen[:width] += seen
        for column, k in enumerate(topk):
            out.topk_hits[:width, column] += hit[..., :k].any(dim=-1).sum(dim=0).cpu().numpy()


def evaluate_sample(
    drafter: BlockDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    limits: SequenceLimits,
    stop_ids: set[int],
    block_sizes: Sequence[int] = (),
    budgets: Sequence[int] = (),
    topk: Sequence[int] = (),
    chunk: int = 128,
) -> SampleResult:
    """All methods for one sample from its cached features [T, n_layers * H] and tokens [T]."""
    outcomes = anchor_outcomes(drafter, features, tokens, limits, block_sizes, budgets, topk, chunk)
    is_stop = [t in stop_ids for t in tokens.tolist()]
    steps = {chain_method(b): chain_steps(a, limits, is_stop) for b, a in outcomes.chain.items()}
    steps.update({tree_method(n): chain_steps(a, limits, is_stop) for n, a in outcomes.tree.items()})
    return SampleResult(outcomes=outcomes, steps=steps)
