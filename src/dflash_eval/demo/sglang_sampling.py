"""SGLang 0.5.23's DFlash sampling at temperature > 0, as its source computes it, for the demo server.

Three pieces, each from one place in SGLang's source (read at /tmp/sgl/wheel/sglang/srt; docs/sampling.md):

- `sampler_probs`: the first token (prefill) comes from the ordinary sampler, `layers/sampler.py`
  `top_k_top_p_min_p_sampling_from_probs_torch`: softmax(logits / T); ranks >= top_k zeroed; top-p cut on the
  cumulative mass of the *unfiltered* sorted probabilities (`(cumsum - p) > top_p` removed); min-p against the
  top probability; the rest sampled in proportion.
- `verify_probs`: what verification accepts against, `speculative/dflash_utils.py`
  `build_speculative_verify_target_probs` (its sparse top-k path, or softmax then the torch fallbacks
  `_dflash_top_k_renorm_prob` and `layers/sampler.py` `top_p_normalize_probs_torch`): softmax over the top-k
  of logits / T (renormalised), then top-p on those renormalised probabilities, renormalised again. No min-p.
- `target_only_verify`: `compute_dflash_sampling_correct_drafts_and_bonus`, i.e. sgl-kernel's
  `tree_speculative_sampling_target_only` on a chain: draft i is accepted when coin_i <= p(d_i) / threshold_acc
  or p(d_i) >= threshold_single (coin_i is the uniform of the previous accepted node); the first rejection
  stops the chain and the bonus is drawn from relu(p - p(d_i) one-hot), i.e. p with the rejected draft's mass
  removed, by inverse CDF with the final coin; when every draft is accepted, from p at the last position.

So the top-k + top-p distribution differs between the first token and the verified ones when both filters are
set (the sampler cuts top-p before renormalising top-k, the verify after), and min_p filters only the first.
dflash 0.1.0's `_sampling_probs` agrees with `verify_probs` (top-k, softmax, top-p on the renormalised
probabilities) except at an exact tie of the cumulative mass with top_p (dflash keeps `cumsum - p < top_p`,
SGLang `<=`) and in the "off" value of top_k (dflash 0, SGLang -1). Coins come from a seeded generator here;
a real SGLang draws them from the device's global RNG (`torch.rand`), so its sampled output is seeded only
under --enable-deterministic-inference, and then only at the sampler.
"""

from __future__ import annotations

import torch


def _filtered_top_k(scaled: torch.Tensor, top_k: int) -> int:
    """SGLang's top_k as a count of kept tokens: -1 (off) and anything past the vocabulary keep all."""
    vocab = scaled.shape[-1]
    return vocab if top_k < 1 or top_k > vocab else int(top_k)


def _top_p_renorm(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_normalize_probs_torch: sort, drop what comes after top_p of mass (`cumsum - p > top_p`), renormalise.
    The sort is torch's own (equal probabilities keep its order), as SGLang's."""
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill((torch.cumsum(ordered, dim=-1) - ordered) > float(top_p), 0.0)
    ordered = ordered / ordered.sum(dim=-1, keepdim=True)
    return torch.zeros_like(ordered).scatter_(-1, order, ordered)


def verify_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """build_speculative_verify_target_probs for one request: rows of logits -> rows of the distribution that
    verification accepts drafts against (temperature > 0). A top-k that filters takes SGLang's sparse path
    (torch.topk, softmax over the kept logits, top-p among them); otherwise softmax and top-p over the vocabulary."""
    scaled = logits.float() / float(temperature)
    k = _filtered_top_k(scaled, top_k)
    if k < scaled.shape[-1]:
        values, indices = torch.topk(scaled, k=k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        if top_p < 1.0:
            probs = _top_p_renorm(probs, top_p)
        return torch.zeros_like(scaled).scatter_(-1, indices, probs)
    probs = torch.softmax(scaled, dim=-1)
    return _top_p_renorm(probs, top_p) if top_p < 1.0 else probs


def sampler_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0) -> torch.Tensor:
    """top_k_top_p_min_p_sampling_from_probs_torch's distribution (renormalised here; SGLang samples the
    unnormalised weights in proportion, which is the same distribution): the prefill token's."""
    probs = torch.softmax(logits.float() / float(temperature), dim=-1)
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


def target_only_verify(candidates: list[int], probs: torch.Tensor, coins: list[float], final_coin: float,
                       threshold_single: float = 1.0, threshold_acc: float = 1.0) -> tuple[int, int]:
    """One chain verification: candidates = [the last token, d_1 .. d_{B-1}], probs[j] = verify_probs at
    candidate j (the distribution of the token after it), coins = B uniforms; returns (accepted drafts, bonus)."""
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
