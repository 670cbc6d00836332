"""The DFlash drafter as a container of weights, in torch alone: what the evaluation loads a checkpoint into.

How, in detail: docs/internals.md (`evaluate/drafter_model.py`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dflash_eval import attention_layout

# Qwen3Config's defaults, for the keys a config.json leaves out (transformers' configuration_qwen3.py).
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "attention_dropout": 0.0,
    "rope_parameters": None,
}
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta


class DrafterConfig:
    """A drafter's config.json as attributes, completed as Qwen3Config completes it.

    As there: a sliding window only with use_sliding_window, key/value heads default to the attention heads, layer
    types default to sliding from max_window_layers on (when there is a window: attention_layout.completed), and
    `rope_theta`/`rope_scaling` become `rope_parameters`. Keys Qwen3 does not know (dflash_config, block_size, ...)
    are attributes as they are.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self._source = copy.deepcopy(dict(values))
        values = copy.deepcopy(self._source)
        rope_scaling, rope_theta = values.pop("rope_scaling", None), values.pop("rope_theta", None)
        self.__dict__.update(QWEN3_DEFAULTS)
        self.__dict__.update(values)
        layout_keys = attention_layout.completed(self.__dict__)
        self.sliding_window, self.layer_types = layout_keys["sliding_window"], layout_keys["layer_types"]
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        rope = dict(rope_scaling or self.rope_parameters or {})
        if not any(isinstance(value, dict) for value in rope.values()):  # one global entry (not per layer type)
            rope.setdefault("rope_theta", DEFAULT_ROPE_THETA if rope_theta is None else rope_theta)
            rope.setdefault("rope_type", rope.get("type", "default"))
        self.rope_parameters = rope

    @property
    def dflash_settings(self) -> dict[str, Any]:
        return getattr(self, "dflash_config", None) or {}

    def layer_layouts(self) -> list[attention_layout.LayerLayout]:
        """Each layer's causality and window as vLLM resolves them (LayoutError: one the forward cannot run)."""
        values = self.to_dict()
        attention_layout.check_runnable(values)
        return attention_layout.vllm_layout(values)

    def draft_value(self, name: str, default: Any = None) -> Any:
        """A DFlash setting: dflash_config's, else the config's own, else `default` (where dflash.model looks)."""
        return self.dflash_settings.get(name, getattr(self, name, default))

    def to_dict(self) -> dict[str, Any]:
        return {key: copy.deepcopy(value) for key, value in self.__dict__.items() if not key.startswith("_")}

    def reference_config(self):
        """transformers' Qwen3Config of the same values (imports transformers: for the fallbacks and the reference)."""
        from transformers import Qwen3Config

        return Qwen3Config.from_dict({k: v for k, v in self._source.items() if k != "auto_map"})


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, in fp32, then scaled by `weight` in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _activation(name: str):
    if name in ("silu", "swish"):
        return F.silu
    from transformers.activations import (
        ACT2FN,  # any other kind: transformers' own, imported only for it
    )

    return ACT2FN[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Default RoPE: cos/sin [.., positions, head_dim] of position * inv_freq, the half-frequencies repeated."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        # On the CPU even inside a meta-device skeleton: arange on the meta device imports torch._refs (and sympy),
        # seconds of an evaluation's start-up (benchmarks/results/startup.md).
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


def rotary_embedding(config: DrafterConfig) -> nn.Module:
    """Ours for the default kind; transformers' Qwen3RotaryEmbedding for any other (yarn, llama3, dynamic, ...)."""
    if config.rope_parameters.get("rope_type") == "default":
        return RotaryEmbedding(config)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config.reference_config())


class Attention(nn.Module):
    """The projections and per-head norms of one layer, and the facts its visibility follows."""

    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        heads, kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        layout = config.layer_layouts()[layer_idx]
        self.is_causal, self.sliding_window = layout.causal, layout.sliding_window


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv: BlockConvolution | None = None
        self.mlp_conv: BlockConvolution | None = None


def _causal_grouped(hidden: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """sum over offsets o of (base[o] + dynamic[o]) * hidden shifted o positions later along axis 1, per channel group.

    hidden [m, L, H]; dynamic [m, L, K, groups] (one weight per group and offset); base [K, H] (one per channel).
    """
    m, length, width = hidden.shape
    groups = width // group_size
    grouped = hidden.view(m, length, groups, group_size)
    dynamic = dynamic.view(m, length, base.shape[0], groups, 1)
    total = torch.zeros_like(grouped)
    for offset in range(base.shape[0]):
        shifted = grouped if offset == 0 else F.pad(grouped[:, :-offset], (0, 0, 0, 0, offset, 0))
        total = total + base[offset].view(1, 1, groups, group_size).to(hidden.dtype) * shifted
        total = torch.addcmul(total, dynamic[:, :, offset], shifted)
    return total.view_as(hidden)


class BlockConvolution(nn.Module):
    """DFlash2's grouped dynamic causal convolution around a sublayer: `prepare` before it, `finish` after."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = hidden.shape[-1] // self.group_size
        dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, groups)
        before, after = dynamic[..., 0, :, :], dynamic[..., 1, :, :]
        return _causal_grouped(hidden, before, self.base_kernel[0], self.group_size), after

    def finish(self, hidden: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return _causal_grouped(hidden, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    """DFlash2's greedy walk over each position's top-k: logit + <codebook(previous) * proj(hidden), codebook(cand)>."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        rank = int(config.draft_value("selector_rank"))
        self.top_k = int(config.draft_value("selector_top_k"))
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(path [m, L], candidates [m, L, k], None) at temperature 0, the only one the evaluation drafts at."""
        if temperature > 0:
            raise ValueError("the evaluation's drafter selects greedily (temperature 0)")
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        previous, path = anchor_ids, []
        for position in range(projected.shape[1]):
            pair = torch.einsum(
                "br,bkr->bk",
                self.predecessor_codebook(previous) * projected[:, position],
                self.successor_codebook(candidates[:, position]),
            )
            best = torch.argmax(unary[:, position] + pair, dim=-1)
            previous = candidates[:, position].gather(-1, best[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, dim=1), candidates, None


class DFlashDraftModel(nn.Module):
    """dflash.model.DFlashDraftModel's parameters (same names and shapes) and facts, without its forward."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.target_layer_ids = config.draft_value("target_layer_ids")
        if self.target_layer_ids is None:
            raise ValueError("no dflash_config.target_layer_ids")
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_size = int(config.draft_value("block_size", 16))
        self.mask_token_id = config.draft_value("mask_token_id")


class DFlash2DraftModel(DFlashDraftModel):
    """dflash.model.DFlash2DraftModel's parameters: a convolution around each sublayer, and the candidate selector."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        kernel_size, group_size = (
            int(config.draft_value("conv_kernel_size")),
            int(config.draft_value("conv_group_size")),
        )
        for layer in self.layers:
            layer.attention_conv = BlockConvolution(config.hidden_size, kernel_size, group_size)
            layer.mlp_conv = BlockConvolution(config.hidden_size, kernel_size, group_size)
        self.candidate_selector = CandidateSelector(config)


def model_class(config: dict[str, Any]) -> type[DFlashDraftModel]:
    return DFlash2DraftModel if "DFlash2DraftModel" in config.get("architectures", []) else DFlashDraftModel


def skeleton(cls: type[DFlashDraftModel], config: DrafterConfig) -> DFlashDraftModel:
    """The module on the meta device: its state dict's names and shapes, no memory."""
    with torch.device("meta"):
        return cls(config)


def materialize(model: DFlashDraftModel) -> DFlashDraftModel:
    """A skeleton's storage on the CPU, uninitialised (every weight is loaded next), its rotary tables computed.

    torch.empty per tensor, not Module.to_empty: its empty_like of meta tensors imports torch._refs and sympy.
    """
    for module in model.modules():
        for name, tensor in module._parameters.items():
            if tensor is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"), requires_grad=tensor.requires_grad
                )
        for name, tensor in module._buffers.items():
            if tensor is not None:
                module._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    model.rotary_emb = rotary_embedding(model.config)
    return model
