"""The tempered, top-k / top-p renormalised distribution a sampling loop draws from, in one place.

Extraction stores the target's log-probability of every completion token under it (`target_logprob`), and
evaluation applies it to the drafter's logits: `dflash_generate` renormalises p and q alike. It lives in the cache
layer because it defines what the cache stores. Two conventions, checked against their sources in
tests/cache/test_sampling.py: "dflash" (dflash 0.1.0's `_sampling_probs`) and "sglang" (SGLang 0.5.23's torch
fallback of its DFlash verify, which a CUDA server never takes). They differ only where the mass before a token
equals top_p exactly, and in their top-k spelling (SGLang's -1 is dflash's 0); `SamplingParams` holds SGLang's.
How they differ from the CUDA filters: docs/sampling.md and docs/sampling_rejection.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash_eval.errors import DflashEvalError

CONVENTIONS = ("dflash", "sglang")


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters in SGLang's spelling: top_k -1 = off, top_p 1.0 = off, min_p 0.0 = off."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    @property
    def dflash_top_k(self) -> int:
        """dflash's spelling of top_k: 0 is off."""
        return 0 if self.top_k < 0 else self.top_k

    def as_dict(self) -> dict[str, float | int]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}


def from_record(record: dict[str, Any], where: str) -> SamplingParams | None:
    """The record's `sampling` object (None for a greedy record); a malformed one is an error naming `where`."""
    sampling = record.get("sampling")
    if sampling is None:
        return None
    try:
        params = SamplingParams(
            temperature=float(sampling["temperature"]),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=int(sampling.get("top_k", -1)),
            min_p=float(sampling.get("min_p", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise DflashEvalError(
            f"{where}: record {record.get('id')!r} has a malformed sampling object {sampling!r} "
            f"({error!r}); re-fetch the dataset"
        ) from None
    if not (
        params.temperature > 0
        and 0 < params.top_p <= 1
        and (params.top_k == -1 or params.top_k >= 1)
        and 0 <= params.min_p < 1
    ):
        raise DflashEvalError(
            f"{where}: record {record.get('id')!r}: sampling {sampling!r} is out of range "
            "(temperature > 0, top_p in (0, 1], top_k -1 or >= 1, min_p in [0, 1)); re-fetch"
        )
    return params


def sampling_probs(logits: torch.Tensor, params: SamplingParams, convention: str = "dflash") -> torch.Tensor:
    """The distribution [..., V] (float32) that `convention`'s loop samples from at these logits [..., V]."""
    if convention not in CONVENTIONS:
        raise DflashEvalError(f"unknown sampling convention {convention!r}; one of {CONVENTIONS}")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    k = params.dflash_top_k
    indices = None
    if 0 < k < vocab:
        scores, indices = torch.topk(scores, k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered
        keep = before < params.top_p if convention == "dflash" else before <= params.top_p
        ordered = ordered * keep
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros(*logits.shape, dtype=probs.dtype, device=probs.device).scatter(-1, indices, probs)
    return probs


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, convention: str = "dflash"
) -> torch.Tensor:
    """log of `sampling_probs(logits)` at `tokens` (logits [..., V], tokens [...]); -inf outside the support."""
    probs = sampling_probs(logits, params, convention)
    return probs.gather(-1, tokens[..., None].long())[..., 0].log()
