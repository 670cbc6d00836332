"""A request's sampling and penalties as SGLang resolves them: read alike by the demo server's SGLang and vLLM
modes."""

from __future__ import annotations

from typing import Any

from dflash_eval.completions import PENALTY_OFF


def penalties_set(params: dict[str, Any] | None) -> dict[str, float]:
    """The request's penalties that are not off (SGLang's off values: repetition 1.0, frequency and presence 0)."""
    return {
        key: params[key]
        for key, off in PENALTY_OFF.items()
        if (params or {}).get(key) is not None and float(params[key]) != off
    }


def sampling_request(params: dict[str, Any], seed: Any) -> dict[str, Any] | None:
    """The request's sampling as SGLang resolves it, None when greedy: temperature 0 (or below SGLang's
    _SAMPLING_EPS, 1e-6) or top_k 1 (sampling_params.py; is_all_greedy is every top_k <= 1)."""
    temperature = float(params.get("temperature") or 0.0)
    top_k = int(params.get("top_k") if params.get("top_k") is not None else -1)
    if temperature < 1e-6 or top_k == 1:
        return None
    top_p = params.get("top_p")
    return {
        "temperature": temperature,
        "top_p": 1.0 if top_p is None else float(top_p),
        "top_k": top_k,
        "min_p": float(params.get("min_p") or 0.0),
        "seed": None if seed is None else int(seed),
    }
