"""Simulated acceptance: the live loop runs its drafter and its target, then exactly k tokens are kept.

A random-weight drafter accepts almost nothing, so the validation loops force acceptance as SGLang 0.5.23's
`SGLANG_SIMULATE_ACC_LEN` does (its `match-expected` draw and `real-draft-token` mode, reproduced here), and
`forced_acceptance` does the same for `dflash_generate` by editing the verify's logits. The semantics with their
SGLang source lines: docs/server.md; how the loops use them: docs/speedup_loops.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dflash_eval.errors import DflashEvalError

# SGLang 0.5.23's env switches (environ.py), with their defaults there
ENV_LENGTH, ENV_METHOD, ENV_TOKEN_MODE = (
    "SGLANG_SIMULATE_ACC_LEN",
    "SGLANG_SIMULATE_ACC_METHOD",
    "SGLANG_SIMULATE_ACC_TOKEN_MODE",
)
MATCH_EXPECTED = "match-expected"


def simulated_length(tau: float, block: int, rng: random.Random) -> int:
    """One step's committed length k in [1, block], as SGLang's `match-expected` draws it."""
    if not tau > 0 or math.isnan(tau):
        raise DflashEvalError(f"simulated acceptance length must be > 0 (SGLang turns it off below), got {tau!r}")
    value = max(1.0, min(float(block), float(tau)))
    lower = int(value // 1)
    if lower >= block:
        return block
    return lower + 1 if rng.random() < value - lower else lower


def expected_length(tau: float, block: int) -> float:
    """The mean committed length of `simulated_length` (the clamp is what a block of `block` allows)."""
    return max(1.0, min(float(block), float(tau)))


@contextmanager
def forced_acceptance(target: torch.nn.Module, tau: float, seed: int = 0) -> Iterator[list[int]]:
    """Within the block, every verify forward of `target` leads the reference loop to commit
    k ~ simulated_length(tau, n) tokens. A verify forward is dflash_generate's call with
    output_hidden_states=True and no logits_to_keep (its prefill passes logits_to_keep=1; the exact
    rollback's replay, demo/reference.py, passes neither). Yields the list of the k drawn, in order."""
    rng = random.Random(seed)
    drawn: list[int] = []
    inner = target.forward

    def forward(*args, **kwargs):
        output = inner(*args, **kwargs)
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        n = ids.shape[1]
        if "logits_to_keep" in kwargs or not kwargs.get("output_hidden_states") or n < 2:
            return output
        k = simulated_length(tau, n, rng)
        drawn.append(k)
        logits = output.logits
        high = logits.new_tensor(torch.finfo(logits.dtype).max)
        if k > 1:  # positions 0..k-2 predict the drafted tokens 1..k-1: accepted
            logits[0, torch.arange(k - 1, device=logits.device), ids[0, 1:k]] = high
        if k < n:  # position k-1 must not predict draft k: rejected, its argmax is the bonus
            logits[0, k - 1, ids[0, k]] = torch.finfo(logits.dtype).min
        return output

    target.forward = forward
    try:
        yield drawn
    finally:
        del target.forward  # the instance attribute goes, the class's forward is back
