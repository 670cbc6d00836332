"""The drafter's forward for many anchors at once, from cached target states.

The reference loop runs the drafter once per verification step: a block [bonus token, mask x (B-1)]
at positions s..s+B-1 that attends to the projected context of every position < s plus itself.
The projected context does not depend on the anchor (each layer only applies its k/v projections
to `hidden_norm(fc(features))`), so we compute the context keys and values once per sample and
then run any number of anchors as a batch, each masked to its own prefix. That is what lets one
pass give the block of every anchor: the chain trajectory, smaller blocks, DDTree and top-k.

Attention visibility follows the reference package exactly, on absolute positions: a context key
t is visible to the block of anchor s iff t < s; causal layers see keys at positions <= the query;
a sliding window W hides keys with query - key >= W (and, for non-causal layers, key - query >= W).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _around_conv(conv: nn.Module | None, hidden: torch.Tensor, inner) -> torch.Tensor:
    """`inner(hidden)`, wrapped in DFlash2's grouped dynamic causal convolution when the layer has one.

    The convolution runs along the block's positions (the block is the only sequence the drafter's
    layers see; the target context enters through the attention's keys and values), so applying it
    per row of a batch of blocks is what the reference loop computes for each block.
    """
    if conv is None:
        return inner(hidden)
    prepared, kernel = conv.prepare(hidden)
    return conv.finish(inner(prepared), kernel)


def visibility_rule(attn: nn.Module, diff: torch.Tensor) -> torch.Tensor | None:
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


@dataclass
class LayerContext:
    """Keys [Hkv, T, D] (normed, rotated) and values [Hkv, T, D] of the projected context."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class SampleContext:
    """Everything anchor-independent for one sample."""

    layers: list[LayerContext]
    cos: torch.Tensor  # [T + block, D]
    sin: torch.Tensor


class BlockDrafter(nn.Module):
    """Runs a `dflash` DFlashDraftModel's or DFlash2DraftModel's weights (with its block convolutions and
    candidate selector) over batches of anchors (differentiable)."""

    def __init__(self, drafter: nn.Module, embed: torch.Tensor, lm_head: torch.Tensor, mask_token_id: int) -> None:
        super().__init__()
        self.drafter = drafter
        self.config = drafter.config
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(drafter.block_size)
        dflash_config = getattr(self.config, "dflash_config", {}) or {}

        def setting(name: str, default: float | None) -> float | None:  # where dflash.model reads its settings
            value = dflash_config.get(name, getattr(self.config, name, default))
            return None if value is None else float(value)

        self.embed_scale = setting("input_embedding_scale", 1.0)
        self.output_multiplier = setting("output_multiplier", 1.0)
        softcap = setting("final_logit_softcapping", None)
        self.softcap = softcap if softcap is not None and softcap > 0 else None
        first = drafter.layers[0].self_attn
        self.head_dim = first.head_dim
        self.kv_groups = first.num_key_value_groups

    # -- context -----------------------------------------------------------------------------
    def rotary(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=like.device)[None]
        cos, sin = self.drafter.rotary_emb(like, positions)
        return cos[0], sin[0]

    def context(self, features: torch.Tensor) -> SampleContext:
        """Project one sample's cached features [T, n_layers * H] into per-layer keys and values."""
        projected = self.drafter.hidden_norm(self.drafter.fc(features))
        cos, sin = self.rotary(features.shape[0] + self.block_size, projected)
        length = features.shape[0]
        layers = []
        for layer in self.drafter.layers:
            attn = layer.self_attn
            keys = attn.k_norm(attn.k_proj(projected).view(length, -1, self.head_dim)).transpose(0, 1)
            values = attn.v_proj(projected).view(length, -1, self.head_dim).transpose(0, 1)
            layers.append(LayerContext(keys=_rope(keys, cos[:length], sin[:length]), values=values))
        return SampleContext(layers=layers, cos=cos, sin=sin)

    # -- blocks ------------------------------------------------------------------------------
    def _visible(self, attn: nn.Module, anchors: torch.Tensor, block: int, ctx_len: int) -> torch.Tensor:
        """Boolean [m, block, ctx_len + block] visibility, reference semantics on absolute positions."""
        device = anchors.device
        offsets = torch.arange(block, device=device)
        query = anchors[:, None] + offsets[None]  # [m, block]
        key = torch.cat([torch.arange(ctx_len, device=device).expand(len(anchors), -1), query], dim=1)
        visible = torch.ones(len(anchors), block, ctx_len + block, dtype=torch.bool, device=device)
        visible[:, :, :ctx_len] = key[:, None, :ctx_len] < anchors[:, None, None]
        rule = visibility_rule(attn, query[:, :, None] - key[:, None, :])
        return visible if rule is None else visible & rule

    def _attention(
        self,
        attn: nn.Module,
        hidden: torch.Tensor,
        ctx: LayerContext,
        ctx_len: int,
        visible: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        m, block, _ = hidden.shape
        q = attn.q_norm(attn.q_proj(hidden).view(m, block, -1, self.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hidden).view(m, block, -1, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(hidden).view(m, block, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
        n_kv = k.shape[1]
        # The scale goes on q (small) rather than on the scores: the passes over the scores
        # [m, heads, block, ctx] are the attention's cost (memory traffic, not arithmetic), so there
        # is one copy of them, masked in place, and softmax accumulates in fp32 inside its kernel.
        q = (q * attn.scaling).reshape(m, n_kv, self.kv_groups, block, self.head_dim)
        ctx_keys, ctx_values = ctx.keys[:, :ctx_len], ctx.values[:, :ctx_len]
        scores = torch.cat(
            [
                torch.einsum("mkgbd,ktd->mkgbt", q, ctx_keys),
                torch.einsum("mkgbd,mkid->mkgbi", q, k),
            ],
            dim=-1,
        )
        scores.masked_fill_(~visible[:, None, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = torch.einsum("mkgbt,ktd->mkgbd", weights[..., :ctx_len], ctx_values) + torch.einsum(
            "mkgbi,mkid->mkgbd", weights[..., ctx_len:], v
        )
        out = out.reshape(m, -1, block, self.head_dim).transpose(1, 2).reshape(m, block, -1)
        return attn.o_proj(out)

    def block_hidden(
        self,
        context: SampleContext,
        tokens: torch.Tensor,
        anchors: torch.Tensor,
        block_size: int | None = None,
        ctx_len: int | None = None,
    ) -> torch.Tensor:
        """Final (normed) drafter hidden states [m, block, H] for blocks anchored at `anchors`.

        `tokens` [T] are the sample's token ids; the block of anchor s is [tokens[s], mask, ...].
        `ctx_len` is max(anchors) when the caller knows it on the host (reading it from the GPU
        would stall the queue of kernels).
        """
        block = self.block_size if block_size is None else block_size
        if ctx_len is None:
            ctx_len = int(anchors.max().item())
        block_ids = torch.full((len(anchors), block), self.mask_token_id, dtype=torch.long, device=tokens.device)
        block_ids[:, 0] = tokens[anchors]
        hidden = F.embedding(block_ids, self.embed) * self.embed_scale
        positions = anchors[:, None] + torch.arange(block, device=anchors.device)[None]
        cos, sin = context.cos[positions], context.sin[positions]
        masks: dict[tuple[bool, int | None], torch.Tensor] = {}  # one per kind of layer, shared by its layers
        for layer, layer_ctx in zip(self.drafter.layers, context.layers):
            attn = layer.self_attn
            kind = (bool(attn.is_causal), attn.sliding_window)
            if kind not in masks:
                masks[kind] = self._visible(attn, anchors, block, ctx_len)
            hidden = hidden + _around_conv(
                getattr(layer, "attention_conv", None),
                layer.input_layernorm(hidden),
                lambda x: self._attention(attn, x, layer_ctx, ctx_len, masks[kind], cos, sin),
            )
            hidden = hidden + _around_conv(
                getattr(layer, "mlp_conv", None), layer.post_attention_layernorm(hidden), layer.mlp
            )
        return self.drafter.norm(hidden)

    def draft_tokens(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy draft [m, B-1] the reference loop proposes from these block states and logits.

        DFlashDraftModel drafts the argmax of each position. DFlash2DraftModel's candidate selector
        walks its top-k candidates left to right, scoring each against the token chosen before it
        (`propose` at temperature 0); we call the model's own selector on the whole batch of anchors.
        """
        selector = getattr(self.drafter, "candidate_selector", None)
        if selector is None:
            return logits.argmax(dim=-1)
        return selector.select(hidden[:, 1:], logits, anchor_ids, 0.0)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits for the mask positions (block positions 1..B-1), as the reference computes them."""
        # A contiguous 2-D input makes the LM head one GEMM; on the strided slice cuBLAS chooses a
        # much slower batched kernel (benchmarks/results/evaluator_speed.md).
        return self.head_logits(hidden[:, 1:].contiguous())

    def head_logits(self, draft: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of final drafter states [..., H] (contiguous), as the model's compute_logits makes them.

        The multiplier is skipped when it is 1 (x * 1.0 is x, bit for bit): on the CPU that pass over
        every logit was a twentieth of the demo's evaluation. tests/evaluate/test_blocks.py compares
        this with compute_logits for a multiplier and a softcap.
        """
        logits = F.linear(draft.reshape(-1, draft.shape[-1]), self.lm_head).view(*draft.shape[:-1], -1)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
