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

from dflash_eval.config import dataset_samples

# SGLang's "off" value of each filter (sampling/sampling_params.py defaults).
OFF = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}


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
    return {"temperature": float(settings["temperature"]), "top_p": float(settings["top_p"]),
            "top_k": int(settings["top_k"]), "min_p": float(settings["min_p"]),
            "seed": record_seed(settings["sampling_seed"], record_id)}


def request_fields(sampling: dict[str, Any] | None, sglang: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sampling fields of one request, as (OpenAI arguments, extra body): none when greedy.

    To SGLang every filter is sent, "off" ones included: a field left out is not "off" there but the model's
    generation_config default (serving_chat/serving_completions fill unset top_p/top_k/min_p from it; Qwen's
    has top_k 20, top_p 0.95). A plain OpenAI server gets top_k/min_p only when they filter (not OpenAI fields).
    """
    if sampling is None:
        return {}, {}
    common = {"top_p": sampling["top_p"], "seed": sampling["seed"]}
    extra = {key: sampling[key] for key in ("top_k", "min_p") if sglang or sampling[key] != OFF[key]}
    return common, extra


def request_identity(settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling part of a record's `request` (what a kept record must match to be reused); empty when greedy,
    so that greedy records stay as they were. The per-record seed follows from `sampling_seed` and the id."""
    if not dataset_samples(settings):
        return {}
    return {key: settings[key] for key in ("top_p", "top_k", "min_p", "sampling_seed")}  # n: a larger n adds ids
