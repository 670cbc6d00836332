"""SGLang 0.5.23's DFlash sampling at temperature > 0, as its source computes it on CUDA, for the demo server.

On CUDA SGLang filters with flashinfer 0.7.2's kernels (`sglang/kernels/ops/sampling/renorm.py:9-13`); its torch
functions are fallbacks CUDA never takes. Each piece takes a `backend`: "flashinfer" (the default: what a CUDA
server computes) or "torch" (SGLang's fallback, kept to test against its source). Each function cites the source it
models; docs/sampling.md ("How the renormalisation is computed") sets them beside dflash 0.1.0's `_sampling_probs`.

No flashinfer kernel ran here: their semantics are read from the CUDA source and held to hand-made cases and a
by-definition reference (tests/demo/test_sglang_sampling.py). The kernels sum floats in another order, so a mass
within rounding of top_p can fall either way. Coins come from a seeded generator here; SGLang draws them from the
device's global RNG, so its sampled output is seeded only under --enable-deterministic-inference, and then only at
the sampler.
"""

from __future__ import annotations

import torch


def _filtered_top_k(scaled: torch.Tensor, top_k: int) -> int:
    """SGLang's top_k as a count of kept tokens: -1 (off) and anything past the vocabulary keep all."""
    vocab = scaled.shape[-1]
    return vocab if top_k < 1 or top_k > vocab else int(top_k)


def _mass_above(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the probability mass and the count of tokens strictly above its value (ties excluded)."""
    ordered, order = probs.sort(dim=-1, descending=True)
    exclusive = torch.cumsum(ordered, dim=-1) - ordered
    first = torch.searchsorted(-ordered.contiguous(), -ordered.contiguous())  # the first rank of each tie group
    mass = torch.zeros_like(probs).scatter_(-1, order, exclusive.gather(-1, first))
    count = torch.zeros_like(order).scatter_(-1, order, first)
    return mass, count


def _flashinfer_top_p_renorm(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_renorm_probs: keep a token iff the mass strictly above its value is below top_p (ties together).

    flashinfer's `TopPRenormProbKernel` (csrc/renorm.cu:26-58 below 2048 entries; include/flashinfer/sampling.cuh:
    1691-1860) cuts by value: a ternary search for the largest v with mass(probs >= v) >= top_p, keeping every token
    at or above it. Not read line by line: the AIR radix path of 2048 entries and more (its kept set is
    `val >= threshold`, air_top_p.cuh:438-454, described as the same cut)."""
    if top_p >= 1.0:
        return probs / probs.sum(dim=-1, keepdim=True)
    mass, _ = _mass_above(probs)
    kept = probs.masked_fill(mass >= float(top_p), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _flashinfer_top_k_renorm(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """top_k_renorm_probs, modelled as the joint kernel's count: keep a token iff fewer than k lie above it (its own
    tie rule was not read line by line)."""
    _, count = _mass_above(probs)
    kept = probs.masked_fill(count >= _filtered_top_k(probs, top_k), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_p_renorm(probs: torch.Tensor, top_p: float, backend: str = "flashinfer") -> torch.Tensor:
    if backend == "flashinfer":
        return _flashinfer_top_p_renorm(probs, top_p)
    return _torch_top_p_renorm(probs, top_p)


def _torch_top_p_renorm(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_normalize_probs_torch: sort, drop what comes after top_p of mass (`cumsum - p > top_p`), renormalise.
    The sort is torch's own (equal probabilities keep its order), as SGLang's."""
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill((torch.cumsum(ordered, dim=-1) - ordered) > float(top_p), 0.0)
    ordered = ordered / ordered.sum(dim=-1, keepdim=True)
    return torch.zeros_like(ordered).scatter_(-1, order, ordered)


def verify_probs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1, backend: str = "flashinfer"
) -> torch.Tensor:
    """build_speculative_verify_target_probs (`speculative/dflash_utils.py:1038`) for one request: rows of logits ->
    rows of the distribution that verification accepts drafts against (temperature > 0). A top-k that filters takes
    SGLang's sparse path (torch.topk, exactly k; softmax over the kept logits, top-p among them); otherwise softmax
    and top-p over the vocabulary. No min-p in the verify."""
    scaled = logits.float() / float(temperature)
    k = _filtered_top_k(scaled, top_k)
    if k < scaled.shape[-1]:
        values, indices = torch.topk(scaled, k=k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        if top_p < 1.0:
            probs = _top_p_renorm(probs, top_p, backend)
        return torch.zeros_like(scaled).scatter_(-1, indices, probs)
    probs = torch.softmax(scaled, dim=-1)
    return _top_p_renorm(probs, top_p, backend) if top_p < 1.0 else probs


def sampler_probs(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    backend: str = "flashinfer",
) -> torch.Tensor:
    """The prefill token's distribution (renormalised here; SGLang samples the filtered weights in proportion,
    which is the same distribution), `layers/sampler.py`.

    Without min_p (:434-440): `top_k_top_p_sampling_from_probs(..., filter_apply_order="joint")`, whose rejection
    loop (`TopKTopPSamplingFromProbKernel`, sampling.cuh:1214, the `count < k && value < p` test) keeps a token iff
    fewer than k tokens and less than top_p of the unfiltered mass lie strictly above its value. With min_p
    (:407-411): top_k_renorm_probs, top_p_renorm_probs on the result, then min_p_sampling_from_probs (p >= min_p x
    max)."""
    probs = torch.softmax(logits.float() / float(temperature), dim=-1)
    if backend == "torch":
        return _torch_sampler_probs(probs, top_p, top_k, min_p)
    if min_p > 0.0:
        probs = _flashinfer_top_p_renorm(_flashinfer_top_k_renorm(probs, top_k), top_p)
        kept = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * float(min_p), 0.0)
    else:
        mass, count = _mass_above(probs)
        kept = probs.masked_fill((count >= _filtered_top_k(probs, top_k)) | (mass >= float(top_p)), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _torch_sampler_probs(probs: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """top_k_top_p_min_p_sampling_from_probs_torch's distribution: top-p on the unfiltered cumulative mass in
    sort order (`(cumsum - p) > top_p` removed), ranks >= top_k zeroed, min-p against the top probability."""
    ordered, order = probs.sort(dim=-1, descending=True)
    cumulative = torch.cumsum(ordered, dim=-1)  # before the top-k cut, as SGLang's
    ranks = torch.arange(ordered.shape[-1]).expand_as(ordered)
    ordered = ordered.masked_fill(ranks >= _filtered_top_k(ordered, top_k), 0.0)
    ordered = ordered.masked_fill((cumulative - ordered) > float(top_p), 0.0)
    if min_p > 0.0:
        ordered = ordered.masked_fill(ordered < ordered[..., :1] * float(min_p), 0.0)
    ordered = ordered / ordered.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, ordered)


def draw(probs: torch.Tensor, coin: float) -> int:
    """Inverse CDF as the kernel samples: the first token whose cumulative weight exceeds coin x total."""
    cumulative = torch.cumsum(probs.double(), dim=-1)
    position = int(torch.searchsorted(cumulative, coin * float(cumulative[-1]), right=True))
    return min(position, probs.shape[-1] - 1)


def target_only_verify(
    candidates: list[int],
    probs: torch.Tensor,
    coins: list[float],
    final_coin: float,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[int, int]:
    """One chain verification: candidates = [the last token, d_1 .. d_{B-1}], probs[j] = verify_probs at
    candidate j (the distribution of the token after it), coins = B uniforms; returns (accepted drafts, bonus).

    compute_dflash_sampling_correct_drafts_and_bonus, i.e. sgl-kernel's tree_speculative_sampling_target_only on a
    chain: draft i is accepted when coin_i <= p(d_i) / threshold_acc or p(d_i) >= threshold_single (coin_i is the
    previous accepted node's uniform); the first rejection stops the chain and the bonus is drawn from p with the
    rejected draft's mass removed, by inverse CDF with the final coin; with every draft accepted, from p at the last
    position."""
    threshold_acc = max(float(threshold_acc), 1e-9)
    accepted, coin = 0, coins[0]
    rejected: int | None = None
    for j in range(1, len(candidates)):
        p = float(probs[j - 1, candidates[j]])
        if coin <= p / threshold_acc or p >= threshold_single:  # prob_acc is p itself: one candidate a level
            accepted, coin = j, coins[j]
            continue
        rejected = candidates[j]
        break
    last = probs[accepted].clone()
    if rejected is not None:
        last[rejected] = 0.0  # relu(target - draft), draft holding the rejected candidate's target mass
    return accepted, draw(last, final_coin)
