"""A Gated DeltaNet hybrid target (Qwen3.5/3.6) over static caches: full-attention layers roll back by position;
a GDN layer's conv and recurrent states cannot, so a verify leaves them as its snapshot and acceptance replays the
recurrence over the kept tokens. The delta-rule kernels are passed in explicitly (GdnKernels). Step by step:
docs/speedup_loops.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dflash_eval.errors import DflashEvalError
from dflash_eval.speedup.forwards.target import _rope, bind_target

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class GdnKernels:
    """The delta-rule implementations a target runs: `chunk` for a block, `recurrent` for one token and the
    rollback's replay (both take transformers'/fla's arguments: [B, T, H, D] inputs, initial_state, ...)."""

    name: str
    chunk: Rule
    recurrent: Rule


def hybrid_unsupported(model: torch.nn.Module) -> str | None:
    """Why StaticHybridTarget cannot run `model` (None when it can): Qwen3.5-style hybrids only."""
    config = getattr(model, "config", None)
    types = list(getattr(config, "layer_types", None) or [])
    if "linear_attention" not in types:
        return "no linear_attention layers: a pure-attention target runs StaticLoop (live_loops/chain.py)"
    layers = getattr(getattr(model, "model", None), "layers", [])
    for layer in layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and not (type(gdn).__name__.endswith("GatedDeltaNet") and hasattr(gdn, "in_proj_qkv")):
            return (
                f"linear layer {type(gdn).__name__}: only Qwen3.5's Gated DeltaNet (separate in_proj_qkv/z/b/a) "
                "is written here"
            )
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}: the conv activation is silu in Qwen3.5"
    return None


@dataclass(frozen=True)
class _Record:
    """One GDN layer's verify of n tokens, kept for `keep`: the conv window and the delta rule's inputs."""

    window: torch.Tensor  # [conv_dim, K-1+n] pre-conv: old conv state, then the n tokens
    q: torch.Tensor  # [1, n, Hv, dk] post-conv, per value head (not l2-normed: the kernels norm them)
    k: torch.Tensor  # [1, n, Hv, dk]
    v: torch.Tensor  # [1, n, Hv, dv]
    g: torch.Tensor  # [1, n, Hv] fp32, log decay
    beta: torch.Tensor  # [1, n, Hv]


class _GdnLayer:
    """One Gated DeltaNet layer over static state buffers (conv [conv_dim, K-1], recurrent [Hv, dk, dv] fp32)."""

    def __init__(self, gdn: torch.nn.Module, kernels: GdnKernels):
        self.gdn, self.kernels = gdn, kernels
        weight = gdn.in_proj_qkv.weight
        self.width = int(gdn.conv_kernel_size) - 1
        self.conv = torch.zeros(gdn.conv_dim, self.width, device=weight.device, dtype=weight.dtype)
        self.recurrent = torch.zeros(
            gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, device=weight.device, dtype=torch.float32
        )
        self.records: dict[int, _Record] = {}

    def prepare(self, n: int) -> None:
        """Allocate the record of an n-token verify (before any capture: a graph's buffers must not move)."""
        if n in self.records:
            return
        gdn, like = self.gdn, self.conv
        self.records[n] = _Record(
            window=torch.zeros(gdn.conv_dim, self.width + n, device=like.device, dtype=like.dtype),
            q=torch.zeros(1, n, gdn.num_v_heads, gdn.head_k_dim, device=like.device, dtype=like.dtype),
            k=torch.zeros(1, n, gdn.num_v_heads, gdn.head_k_dim, device=like.device, dtype=like.dtype),
            v=torch.zeros(1, n, gdn.num_v_heads, gdn.head_v_dim, device=like.device, dtype=like.dtype),
            g=torch.zeros(1, n, gdn.num_v_heads, device=like.device, dtype=torch.float32),
            beta=torch.zeros(1, n, gdn.num_v_heads, device=like.device, dtype=like.dtype),
        )

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def forward(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        """The layer's mixer output for x [1, n, hidden] (normed), after the current state. `commit`: advance
        the state over all n tokens; else leave it and record the n tokens for `keep`."""
        gdn, n = self.gdn, x.shape[1]
        mixed = gdn.in_proj_qkv(x)[0].transpose(0, 1)  # [conv_dim, n]
        window = torch.cat([self.conv, mixed.to(self.conv.dtype)], dim=1)
        weight = gdn.conv1d.weight  # [conv_dim, 1, K]: depthwise
        conv = F.conv1d(window[None].to(weight.dtype), weight, gdn.conv1d.bias, groups=gdn.conv_dim)
        post = F.silu(conv).to(x.dtype)[0].transpose(0, 1)  # [n, conv_dim]
        q, k, v = torch.split(post, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        # q and k per value head (head i reads key head i // r), as transformers 5.17 passes them: its torch kernel
        # (and the H200 image's) needs equal head counts; kernels that group heads themselves compute the same
        r = gdn.num_v_heads // gdn.num_k_heads
        q = q.reshape(1, n, gdn.num_k_heads, gdn.head_k_dim).repeat_interleave(r, dim=2)
        k = k.reshape(1, n, gdn.num_k_heads, gdn.head_k_dim).repeat_interleave(r, dim=2)
        v = v.reshape(1, n, gdn.num_v_heads, gdn.head_v_dim)
        beta = gdn.in_proj_b(x).sigmoid()
        g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
        rule = self.kernels.recurrent if n == 1 else self.kernels.chunk  # as transformers picks for a cached step
        out, final = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=self.recurrent[None],
            output_final_state=commit,
            use_qk_l2norm_in_kernel=True,
        )
        if commit:
            self.recurrent.copy_(final[0])
            self.conv.copy_(window[:, -self.width :])
        else:
            record = self.records.get(n)
            if record is None:  # a buffer first made inside a capture would not outlive it
                raise DflashEvalError(f"no record for a verify of {n} tokens: call prepare({n}) first")
            for buffer, value in (
                (record.window, window),
                (record.q, q),
                (record.k, k),
                (record.v, v),
                (record.g, g),
                (record.beta, beta),
            ):
                buffer.copy_(value)
        z = gdn.in_proj_z(x).reshape(-1, gdn.head_v_dim)
        normed = gdn.norm(out.reshape(-1, gdn.head_v_dim), z).reshape(1, n, -1)
        return gdn.out_proj(normed)

    def keep(self, kept: torch.Tensor, n: int) -> None:
        """After a recorded verify of n tokens, the state after its first `kept` ([1] long, 0..n): the replay
        from the untouched state with g = beta = 0 past kept, and the conv window's columns ending at token kept."""
        record = self.records[n]
        live = (torch.arange(n, device=kept.device) < kept)[None, :, None]
        g = torch.where(live, record.g, torch.zeros_like(record.g))
        beta = torch.where(live, record.beta, torch.zeros_like(record.beta))
        _, final = self.kernels.recurrent(
            record.q,
            record.k,
            record.v,
            g=g,
            beta=beta,
            initial_state=self.recurrent[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        self.recurrent.copy_(final[0])
        columns = kept + torch.arange(self.width, device=kept.device)
        self.conv.copy_(record.window.index_select(1, columns))


def _text_tables(rotary: torch.nn.Module, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, rotary dim] for text positions 0..L-1. Qwen3.5's rotary is multimodal (one position row per
    grid axis, all equal for text): transformers 5.17 indexes them as [3, batch, L] and fails on [batch, L] (the
    H200 image's version); 5.24 expands either, so the three rows are passed."""
    positions = torch.arange(length, device=like.device)[None, None].expand(3, 1, length)
    cos, sin = rotary(like, positions)
    return cos[0], sin[0]


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] dims of each head (Qwen3.5's partial rotary), the rest as they are."""
    rotary = cos.shape[-1]
    return torch.cat([_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


class StaticHybridTarget:
    """A Qwen3.5-style hybrid causal LM over static caches, StaticTarget's interface as the loop uses it:
    `forward(ids, start)` runs ids [1, n] at positions start..start+n-1 (start: a long tensor [1]) and returns the
    logits [n, V] and the concatenated features of `layer_ids` [n, F]. Unlike StaticTarget, a forward either
    commits its n tokens to the GDN states (`commit=True`: a prefill, an autoregressive step) or leaves them
    and records the tokens, and `keep(kept, n)` then commits the first `kept` (a device tensor)."""

    def __init__(self, model: torch.nn.Module, max_len: int, kernels: GdnKernels, layer_ids: list[int] | None = None):
        why = hybrid_unsupported(model)
        if why is not None:
            raise DflashEvalError(f"StaticHybridTarget cannot run this target: {why}")
        inner, weight = bind_target(self, model, max_len, layer_ids)
        self.kernels = kernels
        self.cos, self.sin = _text_tables(inner.rotary_emb, self.max_len, weight[:1])
        self.gdn: dict[int, _GdnLayer] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        kv_heads = model.config.num_key_value_heads
        for i, layer in enumerate(self.layers):
            if getattr(layer, "linear_attn", None) is not None:
                self.gdn[i] = _GdnLayer(layer.linear_attn, self.kernels)
                continue
            shape = (1, kv_heads, self.max_len, layer.self_attn.head_dim)
            self.keys[i] = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.values[i] = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.key_index = torch.arange(self.max_len, device=self.device)

    def prepare(self, n: int) -> None:
        """Allocate the records of an n-token verify (call before capturing a step that records)."""
        for layer in self.gdn.values():
            layer.prepare(n)

    def drop_records(self) -> None:
        """Free every verify record (none may be in a live graph): a profile times one size at a time, and the
        records of all its sizes together would take gigabytes on a 27B target."""
        for layer in self.gdn.values():
            layer.records.clear()

    def reset(self) -> None:
        """Empty GDN states: a new sequence (the attention caches need none: their masks go by position)."""
        for layer in self.gdn.values():
            layer.reset()

    def keep(self, kept: torch.Tensor, n: int) -> None:
        """Commit the first `kept` ([1] long) tokens of the last recorded n-token verify to the GDN states."""
        for layer in self.gdn.values():
            layer.keep(kept, n)

    def _attention(
        self,
        i: int,
        attn: torch.nn.Module,
        x: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        visible: torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        """Qwen3.5's gated attention (q/k RMSNorm, partial rotary, sigmoid output gate) over the static cache."""
        n, d = x.shape[1], attn.head_dim
        query, gate = torch.chunk(attn.q_proj(x).view(1, n, -1, 2 * d), 2, dim=-1)
        q = _rope_partial(attn.q_norm(query).transpose(1, 2), cos, sin)
        k = _rope_partial(attn.k_norm(attn.k_proj(x).view(1, n, -1, d)).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(1, n, -1, d).transpose(1, 2)
        self.keys[i].index_copy_(2, slots, k)
        self.values[i].index_copy_(2, slots, v)
        keys, values = self.keys[i][:, :, :span], self.values[i][:, :, :span]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible[None, None], scale=attn.scaling, enable_gqa=q.shape[1] != keys.shape[1]
        )
        out = out.transpose(1, 2).reshape(1, n, -1) * torch.sigmoid(gate.reshape(1, n, -1))
        return attn.o_proj(out)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        start: torch.Tensor,
        features: bool = True,
        span: int | None = None,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
        commit: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`span`: attend over the first `span` cache positions only (as StaticTarget). `commit`: see the class.
        A tree verify has no GDN equivalent here (its branches would need a state each)."""
        if tree is not None:
            raise DflashEvalError("a tree verify is not supported on a Gated DeltaNet hybrid target")
        inner, n = self.model.model, ids.shape[1]
        span = self.max_len if span is None else int(span)
        slots = start + torch.arange(n, device=self.device)
        visible = self.key_index[:span][None, :] <= slots[:, None]
        cos, sin = self.cos[slots][None, None], self.sin[slots][None, None]
        hidden = inner.embed_tokens(ids)
        captured: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(hidden)
            if i in self.gdn:
                hidden = hidden + self.gdn[i].forward(x, commit)
            else:
                hidden = hidden + self._attention(i, layer.self_attn, x, slots, cos, sin, visible, span)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if i in self.layer_ids and i != last:
                captured[i] = hidden
        normed = inner.norm(hidden)
        if last in self.layer_ids:  # as StaticTarget: the last layer's feature is the final-norm output
            captured[last] = normed
        logits = self.model.lm_head(normed)[0]
        if not (features and self.layer_ids):
            return logits, None
        return logits, torch.cat([captured[i] for i in self.layer_ids], dim=-1)[0]
