"""A dataset's sampling at temperature > 0: the n completions of a prompt, their ids and seeds, and what is sent.

A sampled completion is one draw; tau on it is a random variable, so each prompt gets `n` completions, each
with its own seed, recorded with the parameters it was drawn with (`record["sampling"]`, docs/contracts.md)
so that the offline side (extract, evaluate) and the report know what the server was asked. A greedy
dataset has none of this: its records, ids and requests are exactly as before (no `sampling` key).

The names are SGLang 0.5.23's (entrypoints/openai/protocol.py CompletionRequest and ChatCompletionRequest:
`temperature`, `top_p`, `top_k` (-1 = off), `min_p` (0.0 = off), `seed`, which serving_completions.py and
ChatCompletionRequest.to_sampling_params pass on as `sampling_params.sampling_seed`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from dflash_eval.completions import PENALTY_OFF
from dflash_eval.config import dataset_samples

# SGLang's "off" value of each filter (sampling/sampling_params.py defaults).
OFF = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
# The penalties (completions.PENALTY_OFF) decide the served distribution greedy or sampled (the DFlash verify
# applies them once per step: speculative/dflash_utils.py:236-262). On /v1/chat/completions an unset repetition_penalty is the model's generation_config.json value
# (ChatCompletionRequest.to_sampling_params, protocol.py:1198-1224, under --sampling-defaults model, the default:
# arg_groups/fields/serving.py:232-238; sglang/srt/configs/model_config.py:2210-2240), so each is always sent to SGLang.
OPENAI_FIELDS = ("top_p", "seed", "frequency_penalty", "presence_penalty")  # the rest go in the extra body


def sample_ids(record_id: str, settings: dict[str, Any]) -> list[str]:
    """The ids of one greedy record id's completions: itself when greedy, else `<id>#s<k>` for k < n."""
    if not dataset_samples(settings):
        return [record_id]
    return [f"{record_id}#s{k}" for k in range(int(settings["n"]))]


def record_seed(base: int, record_id: str) -> int:
    """The seed of one sampled completion: stable (from the dataset's sampling_seed and the record id alone, so a
    resumed or partial fetch asks the same), distinct per id, and within SGLang's int64 sampling_seed (31 bits)."""
    digest = hashlib.sha256(f"{int(base)}:{record_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def record_sampling(settings: dict[str, Any], record_id: str) -> dict[str, Any] | None:
    """The record's `sampling` key (None when greedy): what this one completion was drawn with."""
    if not dataset_samples(settings):
        return None
    return {
        "temperature": float(settings["temperature"]),
        "top_p": float(settings["top_p"]),
        "top_k": int(settings["top_k"]),
        "min_p": float(settings["min_p"]),
        "seed": record_seed(settings["sampling_seed"], record_id),
    }


def penalties(settings: dict[str, Any]) -> dict[str, float]:
    """The dataset's penalties (the schema's "off" values unless it sets them)."""
    return {key: float(settings[key]) for key in PENALTY_OFF}


def sent_fields(settings: dict[str, Any], sampling: dict[str, Any] | None, sglang: bool) -> dict[str, Any]:
    """Every field besides the temperature that decides the served distribution, as one request sends it (a
    record's `sampling_sent`).

    To SGLang everything is sent, "off" values included: a field left out is not "off" there but, on the chat
    endpoint, the model's generation_config default (Qwen's has top_k 20, top_p 0.95, and some models a
    repetition_penalty). A plain OpenAI server gets top_k, min_p and the penalties only where they are not off
    (top_k, min_p and repetition_penalty are not OpenAI fields): its own defaults then apply (`defaults_warning`).
    Greedy requests carry the penalties alone (they change the argmax too).
    """
    out: dict[str, Any] = {}
    if sampling is not None:
        out.update({"top_p": sampling["top_p"], "seed": sampling["seed"]})
        out.update({key: sampling[key] for key in ("top_k", "min_p") if sglang or sampling[key] != OFF[key]})
    out.update({key: value for key, value in penalties(settings).items() if sglang or value != PENALTY_OFF[key]})
    return out


def request_fields(
    settings: dict[str, Any], sampling: dict[str, Any] | None, sglang: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """sent_fields split as one request carries them: (OpenAI arguments, extra body)."""
    sent = sent_fields(settings, sampling, sglang)
    return (
        {k: v for k, v in sent.items() if k in OPENAI_FIELDS},
        {k: v for k, v in sent.items() if k not in OPENAI_FIELDS},
    )


def defaults_warning(settings: dict[str, Any], sglang: bool) -> str | None:
    """Why the server's own defaults could decide part of the served distribution, or None (an SGLang server gets
    every field explicitly)."""
    if sglang:
        return None
    unsent = [
        key
        for key, value in {**OFF, **PENALTY_OFF}.items()
        if key not in sent_fields(settings, record_sampling(settings, "any"), sglang)
    ]
    return (
        (
            f"the server is not SGLang, so {', '.join(unsent)} (not OpenAI fields, or at their off values) are not "
            "sent and the server's own defaults apply to them: check that they are off there (for transformers "
            "serve, the model's generation_config.json)"
        )
        if unsent
        else None
    )


def request_identity(settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling part of a record's `request` (what a kept record must match to be reused): the penalties
    always (a record fetched before they were sent may have been served penalized, so it is fetched again), the
    filters and sampling_seed when sampled. The per-record seed follows from `sampling_seed` and the id."""
    if not dataset_samples(settings):
        return penalties(settings)
    return {
        **{key: settings[key] for key in ("top_p", "top_k", "min_p", "sampling_seed")},  # n: a larger n adds ids
        **penalties(settings),
    }
