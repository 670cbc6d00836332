"""The target's log-probability of each completion token under the request's sampling parameters.

What the `rejection` scheme needs from the target (evaluate.rejection): p_T(x_t | x_<t), the tempered,
top-k / top-p renormalised probability that `dflash_generate` verifies with (cache.sampling, convention
"dflash"), one float per token, computed from the same final-norm states as the argmax. Prompt positions
hold NaN: nothing is sampled there.
"""

from __future__ import annotations

import torch

from dflash_eval.cache.sampling import SamplingParams, from_record, token_logprobs
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.capture import ARGMAX_CHUNK


def completion_logprobs(
    lm_head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, prompt_len: int, params: SamplingParams
) -> torch.Tensor:
    """[T] float32: log p_T(tokens[t] | tokens[:t]) for t >= prompt_len (NaN before), ARGMAX_CHUNK rows at a time."""
    out = torch.full((len(tokens),), float("nan"), dtype=torch.float32, device=hidden.device)
    first = max(prompt_len, 1)
    for start in range(first, len(tokens), ARGMAX_CHUNK):
        stop = min(start + ARGMAX_CHUNK, len(tokens))
        logits = lm_head(hidden[start - 1 : stop - 1])
        out[start:stop] = token_logprobs(logits, tokens[start:stop].to(hidden.device), params)
    return out


def sampling_by_id(records: list[dict], completions) -> dict[str, SamplingParams]:
    """Each record's sampling parameters, for a cache with target log-probs: every record sampled, no min_p.

    `dflash_generate` (whose scheme the log-probs serve) has no min-p, and a greedy record has no
    distribution to score: both are errors naming the file, the record and the fix, before the server stops.
    """
    out = {}
    for record in records:
        params = from_record(record, str(completions))
        if params is None:
            raise DflashEvalError(
                f"{completions}: record {record['id']!r} was fetched greedily (no 'sampling'), but "
                "evaluation.verify asks for the rejection scheme, which scores sampled completions; "
                "fetch the dataset at a temperature > 0 or set evaluation.verify: target_only"
            )
        if params.min_p > 0:
            raise DflashEvalError(
                f"{completions}: record {record['id']!r} was sampled with min_p {params.min_p}, "
                "which dflash_generate (the rejection scheme) does not apply; fetch with min_p 0 or "
                "set evaluation.verify: target_only"
            )
        out[str(record["id"])] = params
    return out
