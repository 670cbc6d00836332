"""A pure-attention target over a preallocated (static) KV cache: fixed shapes per call, every position a device
tensor, no host read, so that a forward can be captured as a CUDA graph and the same code runs eagerly on a CPU.
The weights and per-token modules are the Hugging Face model's; only the cache and mask are ours. Rollback is by
position only (docs/speedup_loops.md)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from dflash_eval.errors import DflashEvalError


def _attend(
    attn: torch.nn.Module, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """SDPA of q [1, H, n, d] over the whole key buffer [1, KV, L, d] under a [n, L] bool mask."""
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[None, None], scale=attn.scaling, enable_gqa=q.shape[1] != keys.shape[1]
    )
    return attn.o_proj(out.transpose(1, 2).reshape(1, q.shape[2], -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _tables(rotary: torch.nn.Module, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, d] for positions 0..L-1, computed once (each position's entry is what a call at it computes)."""
    cos, sin = rotary(like, torch.arange(length, device=like.device)[None])
    return cos[0], sin[0]


def static_unsupported(model: torch.nn.Module) -> str | None:
    """Why StaticTarget cannot run `model` (None when it can): it is written for Qwen3-style pure attention
    (q/k RMSNorm, rotary, no recurrent layers); anything else is timed by the HF forward instead."""
    config = getattr(model, "config", None)
    if "linear_attention" in (getattr(config, "layer_types", None) or []):
        return "a Gated DeltaNet hybrid (linear_attention layers): no position rollback of its recurrent state"
    if getattr(config, "model_type", None) != "qwen3":
        return (
            f"model_type {getattr(config, 'model_type', None)!r}: the static cache is written for Qwen3-style "
            "attention (qwen3) only"
        )
    return None


def bind_target(
    target: object, model: torch.nn.Module, max_len: int, layer_ids: list[int] | None
) -> tuple[torch.nn.Module, torch.Tensor]:
    """Set what every static target reads of its HF model (model, max_len, layers, layer_ids, device, dtype) on
    `target`; returns the inner decoder and the embedding weight, which the caches and tables are made from."""
    target.model, target.max_len = model, int(max_len)
    inner = model.model
    target.layers = list(inner.layers)
    target.layer_ids = list(layer_ids or [])
    weight = inner.embed_tokens.weight
    target.device, target.dtype = weight.device, weight.dtype
    return inner, weight


class StaticTarget:
    """A Qwen3-style pure-attention causal LM (e.g. Qwen3ForCausalLM) over a preallocated KV cache of
    `max_len` positions. `forward(ids, start)` runs ids [1, n] at positions start..start+n-1 (start: a long
    tensor [1]) and returns the logits [n, V] and the concatenated features of `layer_ids` [n, F]."""

    def __init__(self, model: torch.nn.Module, max_len: int, layer_ids: list[int] | None = None):
        layer_types = getattr(model.config, "layer_types", None) or []
        if "linear_attention" in layer_types:
            raise DflashEvalError(
                "the static-cache loop runs pure-attention targets only: this one has Gated "
                "DeltaNet (linear_attention) layers, whose recurrent state a position rollback "
                "cannot undo; run it with the eager loop (--loop eager)"
            )
        inner, weight = bind_target(self, model, max_len, layer_ids)
        self.cos, self.sin = _tables(inner.rotary_emb, self.max_len, weight[:1])
        attn = self.layers[0].self_attn
        kv_heads = model.config.num_key_value_heads
        # every layer's cache is a view of one tensor [layers, 1, heads, max_len, head_dim]: moving an accepted
        # tree path's keys (compact) is then one gather and one scatter for all layers, as an engine fuses it,
        # not four launches per layer (0.5 ms a step on an 8B shape in a CUDA graph: speedup_validation.md)
        shape = (len(self.layers), 1, kv_heads, self.max_len, attn.head_dim)
        self.key_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.value_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.keys, self.values = list(self.key_cache.unbind(0)), list(self.value_cache.unbind(0))
        self.key_index = torch.arange(self.max_len, device=self.device)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        start: torch.Tensor,
        features: bool = True,
        span: int | None = None,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`span`: attend over the first `span` cache positions only (a fixed int, so still capturable): a
        profile's step then reads about as many keys as its context holds, as a server's paged attention does.
        `tree` = (depths [n], ancestors [n, n] bool, ancestor-or-self): ids are a tree's nodes in cache slots
        start..start+n-1 at positions start + depth, each seeing the context before start and its ancestors."""
        inner, n = self.model.model, ids.shape[1]
        span = self.max_len if span is None else int(span)
        key_index = self.key_index[:span]
        slots = start + torch.arange(n, device=self.device)
        if tree is None:
            positions = slots
            causal = key_index[None, :] <= positions[:, None]
        else:
            depths, ancestors = tree
            positions = start + depths
            relative = key_index - start
            inside = (relative >= 0) & (relative < n)
            causal = (relative < 0)[None, :] | (ancestors[:, relative.clamp(0, n - 1)] & inside[None, :])
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        hidden = inner.embed_tokens(ids)
        captured: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_norm(attn.q_proj(x).view(1, n, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(1, n, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, attn.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.keys[i].index_copy_(2, slots, k)
            self.values[i].index_copy_(2, slots, v)
            visible = causal
            window = getattr(attn, "sliding_window", None)
            if window is not None:  # (a tree's nodes lie within its depth of the root: slots only overestimate)
                visible = visible & (positions[:, None] - key_index[None, :] < window)
            hidden = hidden + _attend(attn, q, self.keys[i][:, :, :span], self.values[i][:, :, :span], visible)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if i in self.layer_ids and i != last:
                captured[i] = hidden
        normed = inner.norm(hidden)
        if last in self.layer_ids:  # dflash's extract_context_feature: hidden_states[-1] is the final-norm output
            captured[last] = normed
        logits = self.model.lm_head(normed)[0]
        if not (features and self.layer_ids):
            return logits, None
        return logits, torch.cat([captured[i] for i in self.layer_ids], dim=-1)[0]

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """Move the keys and values of cache `slots` (an accepted tree path, root first) to start, start+1, ..."""
        self.move_slots(slots, start + torch.arange(slots.shape[0], device=self.device))

    def move_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Every layer's keys and values at cache slots `source` copied to slots `target` (a gather first, so the
        two may overlap): two launches per cache for all layers."""
        for cache in (self.key_cache, self.value_cache):
            cache.index_copy_(3, target, cache.index_select(3, source))
