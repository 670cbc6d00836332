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
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_eval.evaluate.blocks import BlockDrafter, _rope, visibility_rule
from dflash_eval.evaluate.transfer import to_device

SCORE_BUDGET = 1 << 27  # attention score elements per part of the groups (256 MiB in bf16): bounds memory
PARTS = 4  # the attention's groups run in up to this many parts, each trimmed to its own context and queries
SPLIT_GAIN = 0.75  # a split is taken where it leaves at most this share of the score elements
# Kernels that take an additive mask without storing the scores (CUDA: memory-efficient; CPU: flash); never the
# math backend, which would store them.
FUSED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]
# The fused kernel runs where a group holds at least this many queries: it is slower than the explicit products
# for one 16-token block per sample (chain-B) and faster for the default set's ~200 queries per sample
# (benchmarks/results/evaluator_speed.md, "Side by side: the fused kernel").
FUSED_MIN_QUERIES = 64


class ContextPool:
    """The projected context (normed, rotated keys and values) of the resident samples, one slot each."""

    def __init__(
        self, drafter: BlockDrafter, slots: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> None:
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

    token_ids: torch.Tensor  # [N] block tokens, flat
    positions: torch.Tensor  # [N] absolute positions
    query_gather: torch.Tensor  # [S, Q] flat token of each slot's query q (padding: token 0, hidden, never read)
    padded_index: torch.Tensor  # [N] where each flat token sits in the [S * Q] padded layout
    query_anchor: torch.Tensor  # [S, Q] anchor of the query's block (0 for padding: no context)
    query_pos: torch.Tensor  # [S, Q] absolute position (0 for padding)
    query_row: torch.Tensor  # [S, Q] block (row) id (-1 for padding: padding sees only padding)
    row_index: torch.Tensor  # [m, Bmax] flat token of each block position (N: past the block's end)
    row_flat: torch.Tensor  # [N] where each flat token sits in the [m * Bmax] row layout
    slots: slice | torch.Tensor  # the pool slot of each of the S query groups
    ctx_len: int  # context keys any query may see (max anchor)
    group_ctx: np.ndarray  # [S] context keys the queries of each group may see (host)
    group_queries: np.ndarray  # [S] real queries of each group (host)


@dataclass(frozen=True)
class Padding:
    """Fixed shapes for a forward that a CUDA graph replays (cuda_graphs.py): `tokens` flat tokens, one query group
    per pool slot (`slots` groups, empty ones all padding) of `queries` queries each, `context` context keys."""

    tokens: int
    queries: int
    slots: int
    context: int


FIXED_FIELDS = ["token_ids", "positions", "query_gather", "padded_index", "query_anchor", "query_pos", "query_row"]


def pack_arrays(
    slot: np.ndarray,
    anchor: np.ndarray,
    size: np.ndarray,
    tokens: np.ndarray,
    mask_token_id: int,
    groups: str = "slot",
    padding: Padding | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """The host arrays of `pack` (by PackedBlocks field) and its host facts (batch_slots, contiguous, ctx_len,
    group_ctx, group_queries).

    `padding` (groups "slot" only): the FIXED_FIELDS padded to its shapes; group i is pool slot i. A padded flat
    token (mask token at position 0) is no query or key of any group and its output row is a copy of row 0 (never
    read); a padded group or query has anchor 0 (no context key visible) and row -1 (it sees only padding); context
    keys at or past a real query's anchor are hidden from it, so a longer context changes no real output.
    """
    m = len(slot)
    row_start = np.concatenate([[0], np.cumsum(size)[:-1]])
    n = int(size.sum())
    token_row = np.repeat(np.arange(m), size)
    offset = np.arange(n) - row_start[token_row]
    positions = anchor[token_row] + offset
    token_ids = np.where(offset == 0, tokens[slot, anchor][token_row], mask_token_id)
    if padding is not None and groups == "slot":
        batch_slots, slot_of_row = np.arange(padding.slots), slot
    elif groups == "slot":
        batch_slots, slot_of_row = np.unique(slot, return_inverse=True)
    elif groups == "row" and padding is None:
        batch_slots, slot_of_row = slot, np.arange(m)
    else:
        raise ValueError(f"attention groups {groups!r}: 'slot' or 'row' (padding: 'slot' only)")
    slot_tokens = np.bincount(slot_of_row, weights=size, minlength=len(batch_slots)).astype(np.int64)
    queries = int(slot_tokens.max())
    if padding is not None:
        if n > padding.tokens or queries > padding.queries or int(anchor.max()) > padding.context:
            raise ValueError(
                f"{n} tokens, {queries} queries a group, context {int(anchor.max())}: more than the padding {padding}"
            )
        queries = padding.queries
    slot_first = np.concatenate([[0], np.cumsum(slot_tokens)[:-1]])
    token_slot = slot_of_row[token_row]
    padded = token_slot * queries + (np.arange(n) - slot_first[token_slot])
    query_gather = np.zeros(len(batch_slots) * queries, dtype=np.int64)  # padding reads token 0
    query_gather[padded] = np.arange(n)
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
    if padding is not None:
        extra = padding.tokens - n
        token_ids = np.concatenate([token_ids, np.full(extra, mask_token_id)])
        positions, padded = np.concatenate([positions, np.zeros(extra)]), np.concatenate([padded, np.zeros(extra)])
    lo, hi = int(batch_slots[0]), int(batch_slots[-1]) + 1
    arrays = dict(
        token_ids=token_ids,
        positions=positions,
        query_gather=query_gather.reshape(-1, queries),
        padded_index=padded,
        query_anchor=query_anchor.reshape(-1, queries),
        query_pos=query_pos.reshape(-1, queries),
        query_row=query_row.reshape(-1, queries),
        row_index=row_index.reshape(m, widest),
        row_flat=row_flat,
    )
    if padding is None:
        group_ctx = np.maximum.reduceat(anchor, np.r_[0, np.flatnonzero(np.diff(slot_of_row)) + 1])
        ctx_len, group_queries = int(anchor.max()), slot_tokens
    else:
        ctx_len = padding.context
        group_ctx, group_queries = np.full(padding.slots, ctx_len), np.full(padding.slots, queries)
    facts = dict(
        batch_slots=batch_slots,
        contiguous=hi - lo == len(batch_slots) and groups == "slot",
        ctx_len=ctx_len,
        group_ctx=group_ctx,
        group_queries=group_queries,
    )
    return arrays, facts


def pack(
    slot: np.ndarray,
    anchor: np.ndarray,
    size: np.ndarray,
    tokens: np.ndarray,
    mask_token_id: int,
    device: torch.device,
    groups: str = "slot",
) -> PackedBlocks:
    """Index tensors for blocks (slot, anchor, size), rows sorted by slot; tokens [slots, width] the token ids.

    groups "slot": the queries of all blocks of a sample attend together, to one view of its context;
    "row": each block on its own, to its own gathered copy of its sample's context (padded per block).
    """
    arrays, facts = pack_arrays(slot, anchor, size, tokens, mask_token_id, groups)
    names = list(arrays)
    batch_slots = facts["batch_slots"]
    moved = to_device(list(arrays.values()) + ([] if facts["contiguous"] else [batch_slots]), device)
    lo, hi = int(batch_slots[0]), int(batch_slots[-1]) + 1
    return PackedBlocks(
        **dict(zip(names, moved)),
        slots=slice(lo, hi) if facts["contiguous"] else moved[-1],
        ctx_len=facts["ctx_len"],
        group_ctx=facts["group_ctx"],
        group_queries=facts["group_queries"],
    )


def _visible(attn: nn.Module, batch: PackedBlocks) -> torch.Tensor:
    """Boolean [S, Q, ctx_len + Q]: context keys first, then the slot's own block keys."""
    device = batch.query_pos.device
    key = torch.arange(batch.ctx_len, device=device)
    context = key[None, None] < batch.query_anchor[..., None]
    rule = visibility_rule(attn, batch.query_pos[..., None] - key[None, None])
    if rule is not None:
        context &= rule
    own = batch.query_row[:, :, None] == batch.query_row[:, None, :]
    rule = visibility_rule(attn, batch.query_pos[:, :, None] - batch.query_pos[:, None, :])
    if rule is not None:
        own &= rule
    return torch.cat([context, own], dim=-1)


@dataclass
class Part:
    """Consecutive query groups that attend in one pass, trimmed to the context and queries they need."""

    groups: slice
    see: int  # context keys
    width: int  # queries (and block keys) per group


def _parts(batch: PackedBlocks, heads: int) -> list[Part]:
    """Up to PARTS parts of consecutive groups, each part's stored scores (`heads` rows per query: the fused
    attention stores only its mask, one row per query head of a key head) within SCORE_BUDGET elements.

    More parts trim more padding (each part sees only its own groups' longest context and queries), but each
    costs a dozen more kernel launches per layer, and on a GPU a round is bound by its launches: so a split is
    taken only where it removes at least a quarter of the score elements.
    """
    slots = len(batch.group_ctx)
    queries = int(batch.group_queries.max())
    per_group = heads * queries * (batch.ctx_len + queries)
    smallest = max(1, SCORE_BUDGET // max(per_group, 1))  # groups per part that memory allows

    def split(count: int) -> list[Part]:
        size = max(1, min(-(-slots // count), smallest))
        return [
            Part(
                slice(lo, min(lo + size, slots)),
                int(batch.group_ctx[lo : lo + size].max()),
                int(batch.group_queries[lo : lo + size].max()),
            )
            for lo in range(0, slots, size)
        ]

    def elements(parts: list[Part]) -> int:
        return sum((part.groups.stop - part.groups.start) * part.width * (part.see + part.width) for part in parts)

    best = split(1)
    count = 2
    while count <= PARTS and count <= slots:
        candidate = split(count)
        if elements(candidate) <= SPLIT_GAIN * elements(best):
            best = candidate
        count *= 2
    return best


def fused_attention_for(device: torch.device) -> bool:
    """The fused attention (F.scaled_dot_product_attention's memory-efficient kernel, scores never stored) may run
    on CUDA (where a forward's groups hold FUSED_MIN_QUERIES queries); on a CPU the explicit products always run
    (they give the all-anchor evaluator's bits, which the CPU evaluation promises)."""
    return device.type == "cuda"


def _score_bias(
    visible: torch.Tensor, batch: PackedBlocks, parts: list[Part], dtype: torch.dtype, groups: int | None = None
) -> list[torch.Tensor]:
    """Per part, 0 where a query sees a key and -inf where not, [p, 1, Q_part, see + Q_part] (shared by every layer
    of a kind). Added to the (finite) scores it gives what filling them with -inf gives, bit for bit, and an add is
    much faster than a masked fill (benchmarks/results/score_ops.md). For the fused attention
    (`groups`: query heads per key head) each query's row is repeated for its group's heads: [p, 1, g * Q_part, K]."""
    ctx, queries = batch.ctx_len, batch.query_gather.shape[1]
    biases = []
    for part in parts:
        mask = visible[part.groups, : part.width]
        if part.see < ctx or part.width < queries:
            mask = torch.cat([mask[..., : part.see], mask[..., ctx : ctx + part.width]], dim=-1)
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if groups is not None:
            bias = bias[:, None].expand(-1, groups, -1, -1).reshape(bias.shape[0], -1, bias.shape[-1])
        biases.append(bias[:, None])
    return biases


def _attention(
    drafter: BlockDrafter,
    attn: nn.Module,
    hidden: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: PackedBlocks,
    parts: list[Part],
    biases: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    fused: bool,
) -> torch.Tensor:
    n = hidden.shape[0]
    head_dim, groups = drafter.head_dim, drafter.kv_groups
    q = attn.q_norm(attn.q_proj(hidden).view(n, -1, head_dim))
    k = attn.k_norm(attn.k_proj(hidden).view(n, -1, head_dim))
    v = attn.v_proj(hidden).view(n, -1, head_dim)
    heads = q.shape[1]
    roped = _rope(torch.cat([q, k], dim=1), cos[:, None], sin[:, None])
    q, k = roped[:, :heads] * attn.scaling, roped[:, heads:]
    return attn.o_proj(_attend(q, k, v, keys, values, batch, parts, biases, groups, fused))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: PackedBlocks,
    parts: list[Part],
    biases: list[torch.Tensor],
    groups: int,
    fused: bool = False,
) -> torch.Tensor:
    """Scaled q [N, heads, D], block k, v [N, Hkv, D] against their slots' context: [N, heads * D].

    As in blocks.py: the scale on q, one copy of the scores masked in place (here by adding the bias), softmax in
    fp32 inside. A group's query heads that share a key head are rows of one product ([p, Hkv, groups * Q, D]
    against [p, Hkv, D, T]).
    Padding queries and keys are copies of token 0: a padding key is hidden from every real query (its weight is
    exactly 0), and a padding query's output is never read.
    """
    slots, queries = batch.query_gather.shape
    heads, n_kv, head_dim = q.shape[1], k.shape[1], k.shape[2]
    qkv = torch.cat([q, k, v], dim=1)[batch.query_gather]  # [S, Q, heads + 2 Hkv, D]
    q = qkv[:, :, :heads].view(slots, queries, n_kv, groups, head_dim).permute(0, 2, 3, 1, 4)  # [S, Hkv, g, Q, D]
    k = qkv[:, :, heads : heads + n_kv].transpose(1, 2)  # [S, Hkv, Q, D]
    v = qkv[:, :, heads + n_kv :].transpose(1, 2)
    out = None
    for part, bias in zip(parts, biases):
        lo, hi, see, width = part.groups.start, part.groups.stop, part.see, part.width
        part_q = q[lo:hi, :, :, :width].reshape(hi - lo, n_kv, groups * width, head_dim)
        if fused:
            with sdpa_kernel(FUSED_BACKENDS):
                done = F.scaled_dot_product_attention(
                    part_q,
                    torch.cat([keys[lo:hi, :, :see], k[lo:hi, :, :width]], dim=2),
                    torch.cat([values[lo:hi, :, :see], v[lo:hi, :, :width]], dim=2),
                    attn_mask=bias,
                    scale=1.0,
                )
        else:
            scores = torch.cat(
                [part_q @ keys[lo:hi, :, :see].transpose(-1, -2), part_q @ k[lo:hi, :, :width].transpose(-1, -2)],
                dim=-1,
            )
            scores.view(hi - lo, n_kv, groups, width, -1).add_(bias[:, None])
            weights = torch.softmax(scores, dim=-1)
            done = weights[..., :see] @ values[lo:hi, :, :see] + weights[..., see:] @ v[lo:hi, :, :width]
        done = done.view(hi - lo, n_kv, groups, width, head_dim)
        if len(parts) == 1:
            out = done if width == queries else torch.nn.functional.pad(done, (0, 0, 0, queries - width))
        else:
            if out is None:
                out = q.new_zeros(slots, n_kv, groups, queries, head_dim)
            out[lo:hi, :, :, :width] = done
    return out.permute(0, 3, 1, 2, 4).reshape(slots * queries, -1)[batch.padded_index]


def _padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] with index == len(x) meaning a zero row."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]


def _around_conv(conv: nn.Module | None, hidden: torch.Tensor, inner, batch: PackedBlocks) -> torch.Tensor:
    """DFlash2's block convolution runs along each block's own positions: [m, Bmax] rows, padded at the end
    (the convolution is causal, so the padding never reaches a real position)."""
    if conv is None:
        return inner(hidden)
    width = hidden.shape[-1]
    prepared, kernel = conv.prepare(_padded(hidden, batch.row_index))
    out = inner(prepared.reshape(-1, width)[batch.row_flat])
    return conv.finish(_padded(out, batch.row_index), kernel).reshape(-1, width)[batch.row_flat]


def packed_hidden(
    drafter: BlockDrafter,
    pool: ContextPool,
    batch: PackedBlocks,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """Final (normed) drafter hidden states [N, H] of the packed blocks; cos/sin [max position, D] tables;
    `fused`: the fused attention kernel may run (see fused_attention_for); it does where a group holds at least
    FUSED_MIN_QUERIES queries."""
    fused = fused and int(batch.group_queries.max()) >= FUSED_MIN_QUERIES
    hidden = F.embedding(batch.token_ids, drafter.embed) * drafter.embed_scale
    cos, sin = cos[batch.positions], sin[batch.positions]
    heads = drafter.drafter.layers[0].self_attn.q_proj.out_features // drafter.head_dim
    parts = _parts(batch, drafter.kv_groups if fused else heads)
    biases: dict[tuple[bool, int | None], list[torch.Tensor]] = {}  # per kind of layer, per part
    for layer, keys, values in zip(drafter.drafter.layers, pool.keys, pool.values):
        attn = layer.self_attn
        kind = (bool(attn.is_causal), attn.sliding_window)
        if kind not in biases:
            biases[kind] = _score_bias(
                _visible(attn, batch), batch, parts, hidden.dtype, drafter.kv_groups if fused else None
            )
        keys, values = (
            keys[batch.slots, :, : batch.ctx_len],
            values[batch.slots, :, : batch.ctx_len],
        )  # what any query sees
        hidden = hidden + _around_conv(
            getattr(layer, "attention_conv", None),
            layer.input_layernorm(hidden),
            lambda x: _attention(drafter, attn, x, keys, values, batch, parts, biases[kind], cos, sin, fused),
            batch,
        )
        hidden = hidden + _around_conv(
            getattr(layer, "mlp_conv", None), layer.post_attention_layernorm(hidden), layer.mlp, batch
        )
    return drafter.drafter.norm(hidden)
