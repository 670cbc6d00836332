"""The drafter's blocks for many samples in one forward: tokens packed flat, attention per sample.

A trajectory evaluator needs, each round, a handful of blocks per sample (one per method still
running, of different sizes) over many samples. Packing every block's tokens into one flat batch
makes each weight matrix one GEMM over all of them, whatever their sizes, and the drafter's
weights are read once per forward instead of once per sample and block size. Only the attention
needs to know which sample a token belongs to: the context keys and values of the resident samples
live in a pool, one slot of [Hkv, Tcap, D] per sample and layer, and the queries of one slot (all
of its blocks, concatenated) attend to that slot's context, masked to their own anchor's prefix,
plus the keys of their own block. Visibility is the reference's, as in blocks.py: a context key t
is visible to the block of anchor s iff t < s; causal layers see keys at positions <= the query; a
sliding window W hides keys with query - key >= W (and, for non-causal layers, key - query >= W).

Padding costs only attention (the queries of a slot are padded to the longest slot's); GEMMs,
norms and the MLP run on the real tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dflash_eval.evaluate.blocks import BlockDrafter, _rope

SCORE_BUDGET = 1 << 27  # attention score elements per part of the groups (256 MiB in bf16): bounds memory
PARTS = 4  # the attention's groups run in up to this many parts, each trimmed to its own context and queries


class ContextPool:
    """The projected context (normed, rotated keys and values) of the resident samples, one slot each."""

    def __init__(self, drafter: BlockDrafter, slots: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.capacity = capacity
        # Zeros, not empty: a masked key still meets its value in the weights @ values product (0 * NaN).
        self.keys, self.values = [], []
        for layer in drafter.drafter.layers:
            kv_heads = layer.self_attn.k_proj.out_features // drafter.head_dim
            self.keys.append(torch.zeros(slots, kv_heads, capacity, drafter.head_dim, device=device, dtype=dtype))
            self.values.append(torch.zeros(slots, kv_heads, capacity, drafter.head_dim, device=device, dtype=dtype))

    @staticmethod
    def bytes_per_slot(drafter: BlockDrafter, capacity: int, dtype: torch.dtype) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return sum(2 * layer.self_attn.k_proj.out_features * capacity * element for layer in drafter.drafter.layers)

    def write(self, slot: int, drafter: BlockDrafter, features: torch.Tensor) -> None:
        """Project one sample's features [T, n_layers * H] into its slot."""
        context = drafter.context(features)
        length = features.shape[0]
        for keys, values, layer in zip(self.keys, self.values, context.layers):
            keys[slot, :, :length] = layer.keys
            values[slot, :, :length] = layer.values


@dataclass
class PackedBlocks:
    """One forward's blocks, rows sorted by slot; index tensors on the device."""

    token_ids: torch.Tensor      # [N] block tokens, flat
    positions: torch.Tensor      # [N] absolute positions
    query_index: torch.Tensor    # [S, Q] flat token of each slot's query q (N: padding)
    padded_index: torch.Tensor   # [N] where each flat token sits in the [S * Q] padded layout
    query_anchor: torch.Tensor   # [S, Q] anchor of the query's block (0 for padding: no context)
    query_pos: torch.Tensor      # [S, Q] absolute position (0 for padding)
    query_row: torch.Tensor      # [S, Q] block (row) id (-1 for padding: padding sees only padding)
    row_index: torch.Tensor      # [m, Bmax] flat token of each block position (N: past the block's end)
    row_flat: torch.Tensor       # [N] where each flat token sits in the [m * Bmax] row layout
    slots: slice | torch.Tensor  # the pool slot of each of the S query groups
    ctx_len: int                 # context keys any query may see (max anchor)
    group_ctx: np.ndarray        # [S] context keys the queries of each group may see (host)
    group_queries: np.ndarray    # [S] real queries of each group (host)


def pack(slot: np.ndarray, anchor: np.ndarray, size: np.ndarray, tokens: np.ndarray, mask_token_id: int,
         device: torch.device, groups: str = "slot") -> PackedBlocks:
    """Index tensors for blocks (slot, anchor, size), rows sorted by slot; tokens [slots, width] the token ids.

    groups "slot": the queries of all blocks of a sample attend together, to one view of its context;
    "row": each block on its own, to its own gathered copy of its sample's context (padded per block).
    """
    m = len(slot)
    row_start = np.concatenate([[0], np.cumsum(size)[:-1]])
    n = int(size.sum())
    token_row = np.repeat(np.arange(m), size)
    offset = np.arange(n) - row_start[token_row]
    positions = anchor[token_row] + offset
    token_ids = np.where(offset == 0, tokens[slot, anchor][token_row], mask_token_id)
    if groups == "slot":
        batch_slots, slot_of_row = np.unique(slot, return_inverse=True)
    elif groups == "row":
        batch_slots, slot_of_row = slot, np.arange(m)
    else:
        raise ValueError(f"attention groups {groups!r}: 'slot' or 'row'")
    slot_tokens = np.bincount(slot_of_row, weights=size, minlength=len(batch_slots)).astype(np.int64)
    queries = int(slot_tokens.max())
    slot_first = np.concatenate([[0], np.cumsum(slot_tokens)[:-1]])
    token_slot = slot_of_row[token_row]
    padded = token_slot * queries + (np.arange(n) - slot_first[token_slot])
    query_index = np.full(len(batch_slots) * queries, n, dtype=np.int64)
    query_index[padded] = np.arange(n)
    query_anchor = np.zeros(len(batch_slots) * queries, dtype=np.int64)
    query_anchor[padded] = anchor[token_row]
    query_pos = np.zeros(len(batch_slots) * queries, dtype=np.int64)
    query_pos[padded] = positions
    query_row = np.full(len(batch_slots) * queries, -1, dtype=np.int64)
    query_row[padded] = token_row
    widest = int(size.max())
    row_flat = token_row * widest + offset
    row_index = np.full(m * widest, n, dtype=np.int64)
    row_index[row_flat] = np.arange(n)
    lo, hi = int(batch_slots[0]), int(batch_slots[-1]) + 1
    contiguous = hi - lo == len(batch_slots) and groups == "slot"

    def put(array: np.ndarray, *shape: int) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True).view(*shape) if shape else \
            torch.from_numpy(array).to(device, non_blocking=True)
    return PackedBlocks(
        token_ids=put(token_ids), positions=put(positions), query_index=put(query_index, -1, queries),
        padded_index=put(padded), query_anchor=put(query_anchor, -1, queries), query_pos=put(query_pos, -1, queries),
        query_row=put(query_row, -1, queries), row_index=put(row_index, m, widest), row_flat=put(row_flat),
        slots=slice(lo, hi) if contiguous else put(batch_slots.astype(np.int64)), ctx_len=int(anchor.max()),
        group_ctx=np.maximum.reduceat(anchor, np.r_[0, np.flatnonzero(np.diff(slot_of_row)) + 1]),
        group_queries=slot_tokens,
    )


def _rule(attn: nn.Module, diff: torch.Tensor) -> torch.Tensor | None:
    """Causal and sliding-window visibility on (query - key) positions; None when everything is visible."""
    visible = None
    if attn.is_causal:
        visible = diff >= 0
    if attn.sliding_window is not None:
        window = diff < attn.sliding_window
        if not attn.is_causal:
            window &= -diff < attn.sliding_window
        visible = window if visible is None else visible & window
    return visible


def _visible(attn: nn.Module, batch: PackedBlocks) -> torch.Tensor:
    """Boolean [S, Q, ctx_len + Q]: context keys first, then the slot's own block keys."""
    device = batch.query_pos.device
    key = torch.arange(batch.ctx_len, device=device)
    context = key[None, None] < batch.query_anchor[..., None]
    rule = _rule(attn, batch.query_pos[..., None] - key[None, None])
    if rule is not None:
        context &= rule
    own = batch.query_row[:, :, None] == batch.query_row[:, None, :]
    rule = _rule(attn, batch.query_pos[:, :, None] - batch.query_pos[:, None, :])
    if rule is not None:
        own &= rule
    return torch.cat([context, own], dim=-1)


def _padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] with index == len(x) meaning a zero row."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]


def _attention(drafter: BlockDrafter, attn: nn.Module, hidden: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, batch: PackedBlocks, visible: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    n = hidden.shape[0]
    head_dim, groups = drafter.head_dim, drafter.kv_groups
    q = attn.q_norm(attn.q_proj(hidden).view(n, -1, head_dim))
    k = attn.k_norm(attn.k_proj(hidden).view(n, -1, head_dim))
    v = attn.v_proj(hidden).view(n, -1, head_dim)
    q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    return attn.o_proj(_attend(q * attn.scaling, k, v, keys, values, batch, visible, groups))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            batch: PackedBlocks, visible: torch.Tensor, groups: int) -> torch.Tensor:
    """Scaled q [N, heads, D], block k, v [N, Hkv, D] against their slots' context: [N, heads * D]."""
    slots, queries = batch.query_index.shape
    n_kv, head_dim = k.shape[1], k.shape[2]
    # As in blocks.py: the scale on q, one copy of the scores masked in place, softmax in fp32 inside.
    q = _padded(q, batch.query_index).view(slots, queries, n_kv, groups, head_dim).permute(0, 2, 3, 1, 4)
    k = _padded(k, batch.query_index).permute(0, 2, 1, 3)
    v = _padded(v, batch.query_index).permute(0, 2, 1, 3)
    ctx = batch.ctx_len
    out = q.new_zeros(q.shape) if slots > 1 else None
    for part in _parts(batch, q.shape[1] * q.shape[2]):
        # Each part of consecutive groups (the pool holds samples longest first, so neighbours are alike)
        # sees only the context and queries its own groups need, not the batch's longest.
        see, width = int(batch.group_ctx[part].max()), int(batch.group_queries[part].max())
        mask = visible[part, :width]
        mask = torch.cat([mask[..., :see], mask[..., ctx:ctx + width]], dim=-1) if see < ctx or width < queries \
            else mask
        part_q = q[part, :, :, :width]
        scores = torch.cat([torch.einsum("skgqd,sktd->skgqt", part_q, keys[part, :, :see]),
                            torch.einsum("skgqd,skpd->skgqp", part_q, k[part, :, :width])], dim=-1)
        scores.masked_fill_(~mask[:, None, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        done = (torch.einsum("skgqt,sktd->skgqd", weights[..., :see], values[part, :, :see])
                + torch.einsum("skgqp,skpd->skgqd", weights[..., see:], v[part, :, :width]))
        if out is None:
            out = done if width == queries else torch.nn.functional.pad(done, (0, 0, 0, queries - width))
        else:
            out[part, :, :, :width] = done
    return out.permute(0, 3, 1, 2, 4).reshape(slots * queries, -1)[batch.padded_index]


def _parts(batch: PackedBlocks, heads: int) -> list[slice]:
    """Consecutive groups, up to PARTS of them, each part's scores within SCORE_BUDGET elements."""
    slots = len(batch.group_ctx)
    size = max(1, -(-slots // PARTS))
    per_group = heads * int(batch.group_queries.max()) * (batch.ctx_len + int(batch.group_queries.max()))
    size = max(1, min(size, SCORE_BUDGET // max(per_group, 1)))
    return [slice(lo, min(lo + size, slots)) for lo in range(0, slots, size)]


def _around_conv(conv: nn.Module | None, hidden: torch.Tensor, inner, batch: PackedBlocks) -> torch.Tensor:
    """DFlash2's block convolution runs along each block's own positions: [m, Bmax] rows, padded at the end
    (the convolution is causal, so the padding never reaches a real position)."""
    if conv is None:
        return inner(hidden)
    width = hidden.shape[-1]
    prepared, kernel = conv.prepare(_padded(hidden, batch.row_index))
    out = inner(prepared.reshape(-1, width)[batch.row_flat])
    return conv.finish(_padded(out, batch.row_index), kernel).reshape(-1, width)[batch.row_flat]


def packed_hidden(drafter: BlockDrafter, pool: ContextPool, batch: PackedBlocks, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Final (normed) drafter hidden states [N, H] of the packed blocks; cos/sin [max position, D] tables."""
    hidden = F.embedding(batch.token_ids, drafter.embed) * drafter.embed_scale
    cos, sin = cos[batch.positions], sin[batch.positions]
    masks: dict[tuple[bool, int | None], torch.Tensor] = {}
    for layer, keys, values in zip(drafter.drafter.layers, pool.keys, pool.values):
        attn = layer.self_attn
        kind = (bool(attn.is_causal), attn.sliding_window)
        if kind not in masks:
            masks[kind] = _visible(attn, batch)
        keys, values = keys[batch.slots], values[batch.slots]
        hidden = hidden + _around_conv(
            getattr(layer, "attention_conv", None), layer.input_layernorm(hidden),
            lambda x: _attention(drafter, attn, x, keys, values, batch, masks[kind], cos, sin), batch)
        hidden = hidden + _around_conv(getattr(layer, "mlp_conv", None), layer.post_attention_layernorm(hidden),
                                       layer.mlp, batch)
    return drafter.drafter.norm(hidden)
