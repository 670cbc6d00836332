"""Decoder-layer outputs by forward hooks, and the target's own greedy token per position.

Layer id i is the output of decoder layer i: the residual stream before any norm. Hooks give it
directly; `output_hidden_states` would not (its last entry is the final-norm output). The last layer is
the exception a drafter decides (LAST_LAYER): the reference loop (`dflash_generate`) feeds it
`hidden_states[num_layers]`, the final-norm output, so that is what a drafter trained with it expects
there ("final_norm", the default); "pre_norm" keeps the layer's own output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.layers import check_layer_ids

LAST_LAYER = ("final_norm", "pre_norm")


class _StopForward(Exception):
    """Raised by the last needed hook to skip the remaining layers."""


@dataclass
class Capture:
    """One sequence's captured layers (id -> [T, H]), argmax [T] and target log-probs [T] (None when not wanted)."""

    states: dict[int, torch.Tensor]
    argmax: torch.Tensor | None
    logprob: torch.Tensor | None = None


def text_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(text decoder with .layers/.norm, lm_head) of a CausalLM or of a VLM's language model."""
    inner = model.model
    decoder = getattr(inner, "language_model", inner)
    if getattr(decoder, "layers", None) is None:
        raise DflashEvalError(f"{type(model).__name__} has no decoder layers at model.layers or model.language_model")
    return decoder, model.get_output_embeddings()


ARGMAX_CHUNK = 4096  # positions per lm_head call: logits of 4096 x 248,320 bf16 are 2 GB


def greedy_tokens(lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """argmax of lm_head(hidden) [T, H] -> [T], ARGMAX_CHUNK positions at a time.

    A thinking model's 32k-token completion would otherwise materialize 16 GB of logits at once
    beside a 27B target; chunks bound that to 2 GB and are still large matrix products
    (4096 x 5120 x 248,320 for Qwen3.6-27B), whose cost beside the forward is negligible
    (benchmarks/results/argmax_speed.md).
    """
    return torch.cat(
        [lm_head(hidden[start : start + ARGMAX_CHUNK]).argmax(dim=-1) for start in range(0, len(hidden), ARGMAX_CHUNK)]
    )


def capture_layers(
    model: torch.nn.Module,
    layer_ids: Sequence[int],
    input_ids: torch.Tensor,
    *,
    want_argmax: bool = True,
    stop_after_last: bool | None = None,
    last_layer: str,
    logprobs: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> Capture:
    """Run one sequence ([T] or [1, T]) and keep the requested layer outputs as [T, H] tensors.

    With `want_argmax` the forward completes and the argmax of lm_head(final norm) is returned;
    without it the forward stops after the last needed layer unless `stop_after_last=False`. `logprobs`
    (lm_head, final states [T, H]) -> [T] runs on the same final states (extract.target_logprobs).
    """
    decoder, lm_head = text_parts(model)
    ids = check_layer_ids(layer_ids, len(decoder.layers))
    if stop_after_last is None:
        stop_after_last = not (want_argmax or logprobs)
    if stop_after_last and (want_argmax or logprobs):
        raise DflashEvalError("stop_after_last skips the final norm, so it cannot be combined with want_argmax")
    tokens = input_ids.reshape(1, -1)
    last = max(ids)
    states: dict[int, torch.Tensor] = {}

    def keep(layer_id: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            states[layer_id] = hidden[0].detach()
            if stop_after_last and layer_id == last:
                raise _StopForward

        return hook

    if last_layer not in LAST_LAYER:
        raise DflashEvalError(f"last_layer must be one of {LAST_LAYER}, got {last_layer!r}")
    final = len(decoder.layers) - 1
    # The final norm runs after the last layer, so stopping after that layer would skip it: hook the norm instead.
    handles = [
        (decoder.norm if i == final and last_layer == "final_norm" else decoder.layers[i]).register_forward_hook(
            keep(i)
        )
        for i in ids
    ]
    argmax = logprob = None
    try:
        with torch.inference_mode():
            out = decoder(input_ids=tokens, use_cache=False)
            if want_argmax:
                argmax = greedy_tokens(lm_head, out.last_hidden_state[0])
            if logprobs is not None:
                logprob = logprobs(lm_head, out.last_hidden_state[0])
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return Capture(states={i: states[i] for i in ids}, argmax=argmax, logprob=logprob)
