"""metrics.json's `rejection` section: the chain's exact expected tau under dflash_generate's speculative sampling.

Per sample, the drafter's block at every anchor (evaluate.rejection.anchor_alpha) and the cache's target
log-probs give the step-count distribution given the completion; the section holds both tau conventions as
exact expectations (the token-weighted one over the dataset's independent samples), percentile bootstrap
CIs over samples, or over prompts when a prompt has several draws (stats.bootstrap_per_sample, on per-sample
expectations: E[N / S] and, for the token-weighted one, sum N / sum E[S]), expected acceptance by position and
the expected histogram, for each evaluated chain block size (the drafter's B and evaluation.block_sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dflash_eval import stats
from dflash_eval.cache.sampling import SamplingParams, from_record
from dflash_eval.completions import PENALTY_OFF
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.acceptance import SequenceLimits
from dflash_eval.evaluate.rejection import (
    StepDistribution,
    anchor_alpha,
    expected_token_weighted,
    read_positions,
    step_distribution,
)
from dflash_eval.methods import REJECTION, chain_method

Loaded = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, SequenceLimits]]


def check_cache(cache, drafter_name: str, runner) -> dict:
    """The cache must hold target log-probs, and the drafter must draft DFlash blocks (not DFlash2's selector)."""
    stored = cache.target_logprobs
    if stored is None:
        raise DflashEvalError(
            f"{cache.directory}: evaluation.verify asks for the rejection scheme, but this cache "
            "holds no target log-probs; re-run extraction with evaluation.verify including rejection"
        )
    if getattr(runner.drafter, "candidate_selector", None) is not None:
        raise DflashEvalError(
            f"drafter {drafter_name} is a DFlash2DraftModel, whose sampled proposal is its candidate "
            "selector's, not independent per position; the rejection scheme covers DFlashDraftModel "
            "drafters only: set evaluation.verify: target_only for it"
        )
    return stored


def sample_params(stored: dict, record: dict, completions: str) -> SamplingParams:
    """The record's sampling parameters, which must be those the cache's log-probs were computed with."""
    params = from_record(record, completions)
    penalized = {
        key: value
        for key, value in (record.get("request") or {}).items()
        if key in PENALTY_OFF and float(value) != PENALTY_OFF[key]
    }
    if penalized:
        raise DflashEvalError(
            f"{completions}: record {record['id']!r} was served with {penalized}, which the rejection "
            "scheme's target distribution does not apply (SGLang's verify does); evaluate it with "
            "evaluation.verify: target_only, or fetch without penalties"
        )
    cached = stored["sampling"].get(str(record["id"]))
    if params is None or cached != params.as_dict():
        raise DflashEvalError(
            f"{completions}: record {record['id']!r} has sampling {record.get('sampling')!r}, but the "
            f"cache's target log-probs were computed with {cached!r}; re-run extraction"
        )
    return params


def sample_distribution(
    runner, load: Loaded, params: SamplingParams, stops: set[int], chunk: int, blocks: list[int] | None = None
) -> tuple[dict[int, StepDistribution], int, int]:
    """One sample's step distribution per chain block size b (default: the drafter's B alone), how many tokens the
    chain reads, and how many of them lie outside dflash's support of the target (p_T = 0: scored as rejected drafts, see
    rejection.anchor_alpha). Chain-B<b> is dflash_generate run with block_size b: the same programme over b-token
    blocks, each drafted as such. The first completion token is taken as given: it was drawn at prefill (by
    SGLang from flashinfer's joint top-k/top-p filter, whose support can be wider than dflash's) and never verified."""
    features, tokens, logprob, limits = load()
    is_stop = [t in stops for t in tokens.tolist()]
    read = read_positions(limits, is_stop)
    outside = int((~torch.isfinite(logprob[read.start : read.stop])).sum()) if len(read) else 0
    context = runner.context(features) if limits.total_len - 1 > limits.prompt_len else None
    out = {}
    for block in blocks or [runner.block_size]:
        alpha = anchor_alpha(runner, features, tokens, logprob, limits, params, chunk, block, context)
        out[block] = step_distribution(alpha, limits, is_stop, block)
    return out, outside, len(read)


def outside_support(outside: dict[str, int], tokens: dict[str, int]) -> dict:
    """How many samples and read tokens had a token outside dflash's support (scored at its anchor as a rejection,
    not dropped), with their shares: beside the rejection tau, so a bf16 target's or a tie rule's gaps are seen."""
    hit = sum(1 for n in outside.values() if n)
    read = sum(tokens.values())
    return {
        "samples": hit,
        "samples_scored": len(outside),
        "share_of_samples": hit / len(outside) if outside else 0.0,
        "tokens": int(sum(outside.values())),
        "tokens_read": int(read),
        "share_of_tokens": sum(outside.values()) / read if read else 0.0,
    }


def section(
    dists: dict[str, dict[int, StepDistribution]],
    params: dict[str, SamplingParams],
    blocks: list[int],
    settings: dict,
    clusters: dict[str, str] | None = None,
    outside: dict | None = None,
) -> dict:
    """The `rejection` section of metrics.json from the samples' step distributions per chain block size b in
    `blocks` (the cache's order): one method chain-B<b> each; the bootstrap resamples `clusters` (sample id -> its
    prompt) when given; `outside`: outside_support's counts."""
    methods = {}
    for size in sorted(blocks):
        entry = _method({i: d[size] for i, d in dists.items()}, size, settings, clusters)
        methods[entry["method"]] = entry
    return {
        "scheme": REJECTION,
        "convention": "dflash",
        "sampling": [dict(t) for t in sorted({tuple(sorted(p.as_dict().items())) for p in params.values()})],
        "outside_support": outside or outside_support({}, {}),
        "methods": methods,
    }


def _method(dists: dict[str, StepDistribution], block: int, settings: dict, clusters: dict[str, str] | None) -> dict:
    """One chain block size's entry: both tau conventions as exact expectations, CIs, rates and histogram."""
    used = {i: d for i, d in dists.items() if d.tokens}
    labels = None if clusters is None else [clusters.get(i, i) for i in used]
    means = np.array([d.expected_tau for d in used.values()])
    tokens = np.array([d.tokens for d in used.values()], dtype=float)
    expected_steps = np.array([d.expected_steps for d in used.values()])
    produced = sum((d.produced for d in used.values()), np.zeros(block))
    total_steps = float(expected_steps.sum())
    method = {
        "method": chain_method(block),
        "scheme": REJECTION,
        "block_size": block,
        "tau_mean_of_samples": float(means.mean()) if len(means) else float("nan"),
        "tau_token_weighted": expected_token_weighted(list(used.values())),
        "ci95": stats.bootstrap_per_sample(
            means, tokens, expected_steps, settings["bootstrap"], settings["seed"], clusters=labels
        ),
        "samples": len(used),
        "expected_steps": total_steps,
        "tokens": int(tokens.sum()),
        "acceptance_by_position": [
            float(produced[k:].sum() / total_steps) if total_steps else float("nan") for k in range(1, block)
        ],
        "expected_histogram": {str(m): float(produced[m - 1]) for m in range(1, block + 1)},
        "per_sample": [
            {
                "id": i,
                "tokens": d.tokens,
                "expected_steps": d.expected_steps,
                "expected_tau": d.expected_tau,
                "tau_variance": d.tau_variance,
            }
            for i, d in used.items()
        ],
    }
    return method
