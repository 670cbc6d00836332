"""The DFlash drafter over a static KV cache, as forwards/target.py's target: its context keys live in its own
buffer at their absolute positions, as dflash's loop keeps them (cropped back to the block start after a draft)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from dflash_eval.speedup.forwards.target import _attend, _rope, _tables


class StaticDrafter:
    """dflash's DFlashDraftModel over a preallocated context-KV buffer. `context(features, start)` projects
    context rows [m, F] at positions start.. into the buffer; `draft(features, ctx_start, block, start)`
    projects the b rows of the last verify at ctx_start.. (the rejected ones among them are overwritten by the
    block's own keys: the block starts where the accepted rows end), then runs the block [bonus, mask x
    (b-1)] at start..start+b-1 and returns its b-1 greedy drafts.

    `head_logits` maps the final drafter states [1, b-1, H] to logits [1, b-1, V] as dflash's compute_logits does
    (the LM head, then its multiplier and softcap): the drafter may be dflash's class, which has compute_logits,
    or the evaluator's own (evaluate/drafter_model.py: the same parameters, no forward), which has not."""

    def __init__(
        self,
        drafter: torch.nn.Module,
        embed: torch.Tensor,
        head_logits: Callable[[torch.Tensor], torch.Tensor],
        max_len: int,
    ):
        self.drafter, self.embed, self.head_logits, self.max_len = drafter, embed, head_logits, int(max_len)
        config = drafter.config
        settings = getattr(config, "dflash_config", {}) or {}
        self.scale = float(settings.get("input_embedding_scale", getattr(config, "input_embedding_scale", 1.0)))
        self.mask_token_id = int(drafter.mask_token_id)
        self.layers = list(drafter.layers)
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cos, self.sin = _tables(drafter.rotary_emb, self.max_len, weight[:1])
        attn = self.layers[0].self_attn
        shape = (1, config.num_key_value_heads, self.max_len, attn.head_dim)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.key_index = torch.arange(self.max_len, device=self.device)

    def _write_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        projected = self.drafter.hidden_norm(self.drafter.fc(features[None]))
        positions = start + torch.arange(features.shape[0], device=self.device)
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            rows = projected.shape[1]
            k = attn.k_norm(attn.k_proj(projected).view(1, rows, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(projected).view(1, rows, -1, attn.head_dim).transpose(1, 2)
            self.keys[i].index_copy_(2, positions, _rope(k, cos, sin))
            self.values[i].index_copy_(2, positions, v)

    @torch.inference_mode()
    def context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        self._write_context(features, start)

    @torch.inference_mode()
    def draft(
        self, features: torch.Tensor, ctx_start: torch.Tensor, bonus: torch.Tensor, start: torch.Tensor, block: int
    ) -> torch.Tensor:
        return self.draft_logits(features, ctx_start, bonus, start, block).argmax(-1)

    @torch.inference_mode()
    def draft_logits(
        self, features: torch.Tensor, ctx_start: torch.Tensor, bonus: torch.Tensor, start: torch.Tensor, block: int
    ) -> torch.Tensor:
        """The block's logits for positions 1..b-1 [b-1, V] (a DDTree is built from them: live_loops/tree.py)."""
        self._write_context(features, ctx_start)
        ids = torch.full((1, block), self.mask_token_id, device=self.device, dtype=torch.long)
        ids[0, :1] = bonus
        hidden = F.embedding(ids, self.embed) * self.scale
        positions = start + torch.arange(block, device=self.device)
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        query, key = positions[:, None], self.key_index[None, :]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_norm(attn.q_proj(x).view(1, block, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(1, block, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(1, block, -1, attn.head_dim).transpose(1, 2)
            self.keys[i].index_copy_(2, positions, _rope(k, cos, sin))
            self.values[i].index_copy_(2, positions, v)
            # dflash's _attention_mask, keys at their absolute positions (its cache holds positions 0..)
            visible = key < start + block
            if attn.is_causal:
                visible = visible & (key <= query)
            if attn.sliding_window is not None:
                visible = visible & (query - key < attn.sliding_window)
                if not attn.is_causal:
                    visible = visible & (key - query < attn.sliding_window)
            hidden = hidden + _attend(attn, _rope(q, cos, sin), self.keys[i], self.values[i], visible)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.drafter.norm(hidden)[:, 1:]
        return self.head_logits(hidden)[0]
