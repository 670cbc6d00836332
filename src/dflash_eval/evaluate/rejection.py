"""The `rejection` scheme: exact expected tau under `dflash_generate(temperature=T)`'s speculative sampling.

`dflash_generate` at T > 0 drafts each block position j from the drafter's tempered, renormalised q_j
(cache.sampling), accepts it with probability min(1, p_j / q_j) and, on the first rejection, emits a token
from the residual (p - q)+. Given the emitted path x, position j of the block anchored at a (earlier
positions accepted) is accepted with probability alpha_j = min(1, q_j(x_{a+j}) / p_T(x_{a+j} | x_<a+j)),
and the steps are a Markov chain over anchors: from anchor a, m tokens are produced with probability
prod_{j<m} alpha_j (1 - alpha_m), and the last possible length L (the block's end, the token budget or the
stop token) takes the rest, prod_{j<L} alpha_j. docs/sampling_rejection.md derives it.

`step_distribution` runs that chain for one sample and keeps the whole distribution of the step count S,
so both tau conventions are exact expectations: per sample E[N / S] (N, the tokens produced, is fixed by
the path), and over the dataset E[sum N / sum S] (`expected_token_weighted`, by convolving the samples'
independent step counts). tests/evaluate/test_rejection.py holds it to brute-force enumeration of the
loop's own mechanics and to `dflash_generate` run over many seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_eval.cache.sampling import SamplingParams, token_logprobs
from dflash_eval.evaluate.acceptance import SequenceLimits
from dflash_eval.evaluate.all_anchor import anchor_blocks


@dataclass
class StepDistribution:
    """One sample's step count distribution given its path, and expected counts per step length."""

    tokens: int  # N: tokens produced from the first anchor to the end (fixed by the path)
    steps_pmf: np.ndarray  # P(S = s), s = 0 .. N
    produced: np.ndarray  # [B]: expected number of steps producing m = 1 .. B tokens

    @property
    def expected_steps(self) -> float:
        return float(np.dot(np.arange(len(self.steps_pmf)), self.steps_pmf))

    def _tau_moment(self, power: int) -> float:
        s = np.arange(1, len(self.steps_pmf))
        return float(np.dot((self.tokens / s) ** power, self.steps_pmf[1:]))

    @property
    def expected_tau(self) -> float:
        """E[N / S]: the expectation of this sample's tau (its mean acceptance length); nan without steps."""
        return self._tau_moment(1) if self.tokens else float("nan")

    @property
    def tau_variance(self) -> float:
        return self._tau_moment(2) - self.expected_tau**2 if self.tokens else float("nan")


def _end(limits: SequenceLimits, is_stop: Sequence[bool]) -> int:
    """Where every trajectory ends: the first stop token after the first anchor, else max_length - 1."""
    for t in range(limits.prompt_len + 1, min(limits.max_length - 1, limits.total_len)):
        if is_stop[t]:
            return t
    return limits.max_length - 1


def read_positions(limits: SequenceLimits, is_stop: Sequence[bool]) -> range:
    """The positions whose p_T the chain reads: after the first completion token (drawn at prefill, never verified)
    and before the trajectory's end (the last token is produced whatever the coins, so its probability is not read)."""
    start = limits.prompt_len
    if start >= limits.total_len or is_stop[start] or start + 1 >= limits.max_length:
        return range(0)
    return range(start + 1, _end(limits, is_stop))


def step_distribution(
    alpha: np.ndarray, limits: SequenceLimits, is_stop: Sequence[bool], block_size: int
) -> StepDistribution:
    """The chain over anchors for one sample (dflash_generate's step rule: acceptance.chain_steps).

    `alpha[i, j - 1]` is the acceptance probability of block position j at anchor prompt_len + i given the
    earlier ones accepted (entries past the anchor's verify size or past the end are not read).
    """
    start = limits.prompt_len
    if start >= limits.total_len or is_stop[start] or start + 1 >= limits.max_length:
        return StepDistribution(0, np.ones(1), np.zeros(block_size))
    end = _end(limits, is_stop)
    if end >= limits.total_len:
        raise ValueError(f"the step chain would run past the completion (end {end}, {limits.total_len} tokens)")
    n = end - start
    reach = np.zeros((n + 1, n + 1))  # [anchor - start, steps so far]
    reach[0, 0] = 1.0
    produced = np.zeros(block_size)
    for i in range(n):
        mass = reach[i]
        if not mass.any():
            continue
        anchor = start + i
        gamma = min(block_size, limits.max_length - anchor) - 1
        longest = min(gamma + 1, end - anchor)
        survive = 1.0
        for m in range(1, longest + 1):
            p = survive if m == longest else survive * (1.0 - float(alpha[i, m - 1]))
            if p > 0:
                reach[i + m, 1:] += p * mass[:-1]
                produced[m - 1] += p * mass.sum()
            survive *= float(alpha[i, m - 1]) if m < longest else 1.0
    return StepDistribution(n, reach[n].copy(), produced)


def expected_token_weighted(samples: Sequence[StepDistribution]) -> float:
    """E[sum N / sum S] over independent samples: the step counts' sum has the convolution of their pmfs."""
    used = [s for s in samples if s.tokens]
    if not used:
        return float("nan")
    length = sum(len(s.steps_pmf) - 1 for s in used) + 1
    size = 1 << (length - 1).bit_length()
    spectrum = np.ones(size // 2 + 1, dtype=complex)
    for sample in used:
        spectrum *= np.fft.rfft(sample.steps_pmf, size)
    total = np.clip(np.fft.irfft(spectrum, size)[:length], 0.0, None)
    total /= total.sum()
    steps = np.arange(length)
    tokens = sum(s.tokens for s in used)
    return float(np.dot(total[1:], tokens / steps[1:]))


@torch.inference_mode()
def anchor_alpha(
    drafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    target_logprob: torch.Tensor,
    limits: SequenceLimits,
    params: SamplingParams,
    chunk: int = 128,
    block: int | None = None,
    context: torch.Tensor | None = None,
) -> np.ndarray:
    """alpha [n_anchors, b - 1] from the drafter's block of b tokens at every anchor (as dflash_generate with
    block_size b drafts it there; b defaults to the drafter's B, and a shorter block is drafted as a b-token block,
    not cut from the B-token one: full-attention layers see the whole block).

    `target_logprob[t]` is log p_T(x_t | x_<t) under `params` (the cache's `target_logprob`); q is the same
    renormalisation of the drafter's logits. Positions past the sequence get 1 (never read: see step_distribution).
    A token outside dflash's support (p_T = 0: log-prob -inf), which dflash_generate could not have emitted, gets
    alpha 0: the step ends at its anchor's draft of it, the token taken as that step's correction (a lower bound;
    no loop can say more, and the sample is kept: rejection_metrics counts such tokens).
    `context` is drafter.context(features), when the caller already has it (one per sample for every b).
    """
    block = drafter.block_size if block is None else int(block)
    n_anchors = max(0, limits.total_len - 1 - limits.prompt_len)
    alpha = np.ones((n_anchors, block - 1))
    if context is None and n_anchors:
        context = drafter.context(features)
    for drafted in anchor_blocks(drafter, context, tokens, limits, block, chunk):
        width = drafted.size - 1
        positions = drafted.anchors[:, None] + 1 + torch.arange(width, device=tokens.device)[None]
        inside = positions < tokens.shape[0]
        clamped = positions.clamp(max=tokens.shape[0] - 1)
        log_q = token_logprobs(drafted.logits.float(), tokens[clamped], params)
        log_p = target_logprob.to(log_q.device)[clamped]
        ratio = torch.exp(torch.clamp(log_q - log_p, max=0.0))
        values = torch.where(
            inside, torch.where(torch.isneginf(log_p), torch.zeros_like(ratio), ratio), torch.ones_like(log_q)
        )
        alpha[drafted.part, :width] = values.double().cpu().numpy()
    return alpha
