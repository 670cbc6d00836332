"""Time one serving step of the target while extraction has it loaded: T_AR and T_verify(n).

Batch 1, a KV cache prefilled with `context_tokens` random tokens; each timed forward appends n
tokens to a copy of the prefilled cache, made untimed before each call. A DDTree of N nodes verifies N + 1 tokens
under a tree mask; we time N + 1 tokens under the causal mask, the same matrix work (a tree
mask's attention differs only in which scores it keeps). The result is written beside the cache
as `serving_profile.json` (the format of cache/serving_profile.py) with each median's spread.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_eval.cache.serving_profile import PROFILE_NAME
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.speedup.timing import timed_ms, wanted

log = logging.getLogger(__name__)

# chain blocks 1..16 and DDTree budgets 2^k (N + 1 tokens), 2^k itself for the interpolation
DEFAULT_VERIFY_TOKENS = [1, 2, 4, 8, 16, 17, 33, 65, 129, 257, 513, 1025]  # linear in between
SECONDS_PER_SIZE = 1.0  # after 3 repeats a size stops once it has taken this long


@torch.inference_mode()
def measure_target(model: torch.nn.Module, context_tokens: int, repeats: int,
                   verify_tokens: Sequence[int] = DEFAULT_VERIFY_TOKENS, seed: int = 0) -> dict[str, Any]:
    """The target's step profile: t_ar_ms (= T_verify(1)), t_verify_ms per n, and their spread."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, context_tokens + max(verify_tokens)), generator=generator).to(device)
    prefilled = DynamicCache(config=model.config)
    model(ids[:, :context_tokens], past_key_values=prefilled, use_cache=True)
    cache = [prefilled]

    def fresh_cache() -> None:
        cache[0] = copy.deepcopy(prefilled)

    def step(n: int) -> Callable[[], None]:
        positions = torch.arange(context_tokens, context_tokens + n, device=device)[None]

        def forward() -> None:
            model(ids[:, context_tokens:context_tokens + n], position_ids=positions, past_key_values=cache[0],
                  use_cache=True, logits_to_keep=n)
        return forward

    verify, spread = {}, {}
    started = time.perf_counter()
    for n in sorted({int(n) for n in verify_tokens} | {1}):
        timing = timed_ms(step(n), device, repeats, setup=fresh_cache, budget_s=SECONDS_PER_SIZE)
        verify[str(n)], spread[str(n)] = timing["ms"], [timing["min_ms"], timing["max_ms"]]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log.info("target step profile: %d sizes x %d repeats in %.1f s; T_AR %.2f ms", len(verify), repeats,
             time.perf_counter() - started, verify["1"])
    return {"source": "measured at extraction (dflash-eval extract/profile.py)", "device": name,
            "context_tokens": context_tokens, "repeats": repeats, "seconds_per_size": SECONDS_PER_SIZE, "t_ar_ms": verify["1"], "t_verify_ms": verify,
            "spread": {"t_verify_ms": spread, "note": "min and max of the repeats"},
            "torch": torch.__version__}


def write_target_profile(model: torch.nn.Module, out: str | Path, options: dict[str, Any]) -> Path | None:
    """Measure and write `serving_profile.json` into the cache directory; a failure only warns."""
    if not wanted(options, next(model.parameters()).device):
        return None
    path = Path(out) / PROFILE_NAME
    try:
        profile = measure_target(model, int(options["context_tokens"]), int(options["repeats"]))
    except Exception as error:  # noqa: BLE001  the cache is what took hours: a profile is never worth losing it
        log.warning("no serving profile: timing the target failed (%s: %s)", type(error).__name__, error)
        return None
    atomic_write_json(path, profile)
    return path
