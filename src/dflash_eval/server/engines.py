"""Which engine serves at a URL, and how each engine frees its GPU memory and takes it back (the release kind).

SGLang 0.5.23 (docs/sglang_protocol.md): POST /release_memory_occupation and /resume_memory_occupation, with
--enable-memory-saver. vLLM 0.34.0 (docs/vllm_protocol.md): POST /sleep?level=1 and /wake_up, with
--enable-sleep-mode; both are development routes, registered only with VLLM_SERVER_DEV_MODE=1. Level 1 offloads
the weights to CPU memory and drops the KV cache; level 2 discards the weights, which a wake-up does not bring
back (v1/worker/gpu_worker.py, sleep and _discardable_parameters), so only level 1 serves the same model after.
vLLM's /health stays 200 while asleep; GET /is_sleeping says whether it woke.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_eval.server.http import http_request

VLLM_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
VLLM_SLEEP_LEVEL = 1
# the vLLM sleep-mode routes (entrypoints/serve/dev/sleep/api_router.py), as vllm_protocol's SleepRoutes name them
VLLM_SLEEP_ROUTE, VLLM_WAKE_ROUTE, VLLM_SLEEPING_ROUTE = "POST /sleep", "POST /wake_up", "GET /is_sleeping"


@dataclass(frozen=True)
class MemoryCalls:
    """One engine's calls that free and take back its GPU memory, and what the server needs for them."""

    engine: str
    release: str  # path (and query) POSTed to free the memory
    resume: str  # path POSTed to take it back
    needs: str  # how to start the server so that the calls work (for the error messages)
    sleeping: str | None = None  # a GET path answering {"is_sleeping": bool}, checked after resume


SGLANG_CALLS = MemoryCalls(
    "sglang",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "start SGLang with --enable-memory-saver (it releases only while no request is running)",
)
VLLM_CALLS = MemoryCalls(
    "vllm",
    f"{VLLM_SLEEP_ROUTE.split()[1]}?level={VLLM_SLEEP_LEVEL}",
    VLLM_WAKE_ROUTE.split()[1],
    f"start vLLM with --enable-sleep-mode and {VLLM_DEV_MODE_ENV}=1 in its environment (the "
    "sleep routes are development routes)",
    sleeping=VLLM_SLEEPING_ROUTE.split()[1],
)


def vllm_version(base_url: str, key_env: str | None = None) -> str | None:
    """The vLLM version when the server answers `GET /version` as vLLM does ({"version": "..."}, alone), else None."""
    status, body = http_request(base_url + "/version", timeout=30.0, key_env=key_env)
    try:
        value = json.loads(body) if status == 200 else None
    except ValueError:
        return None
    if isinstance(value, dict) and set(value) == {"version"} and isinstance(value["version"], str):
        return value["version"]
    return None


def memory_calls(settings: dict[str, Any]) -> MemoryCalls:
    """The release calls of server.engine; for `auto`, vLLM's when the server answers /version as vLLM does."""
    engine = settings.get("engine") or "auto"
    if engine == "auto":
        engine = "vllm" if vllm_version(settings["base_url"], settings.get("api_key_env")) is not None else "sglang"
    return VLLM_CALLS if engine == "vllm" else SGLANG_CALLS
