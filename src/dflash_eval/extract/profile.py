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

from dflash_eval.cache.serving_profile import PROFILE_NAME, load_profile
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.speedup.timing import compare, timed_ms, wanted

log = logging.getLogger(__name__)

CHAIN_BLOCKS = range(2, 17)  # every chain block of a drafter of block <= 16
SECONDS_PER_SIZE = 4.0  # past this a size stops repeating, unstable (said in the profile)


def sizes_to_measure(options: dict[str, Any]) -> list[int]:
    """1 (T_AR), every chain block 2..16 and `block_sizes` beyond, N + 1 per DDTree budget: what methods verify.

    `options` is the extract settings' speedup section with the evaluation's `block_sizes` and
    `ddtree_budgets` beside it (config.extract_runtime passes them, outside the cache's params)."""
    blocks = options.get("block_sizes")
    chains = set(CHAIN_BLOCKS) | (set(blocks) if isinstance(blocks, list) else set())
    # N + 1, methods.TREE.verified's rule (not imported: a change to methods.py must not rerun extraction;
    # tests/extract/test_profile.py holds the two equal)
    trees = {int(n) + 1 for n in options.get("ddtree_budgets") or []}
    return sorted({1} | {int(b) for b in chains} | trees)


DEFAULT_VERIFY_TOKENS = sizes_to_measure({"ddtree_budgets": [8, 16, 32, 64, 128, 256, 512, 1024]})


@torch.inference_mode()
def measure_target(model: torch.nn.Module, context_tokens: int, repeats: int,
                   verify_tokens: Sequence[int] = DEFAULT_VERIFY_TOKENS, seed: int = 0,
                   seconds_per_size: float | None = None) -> dict[str, Any]:
    """The target's step profile: t_ar_ms (= T_verify(1)), t_verify_ms per n, their spread and CIs."""
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

    cap = SECONDS_PER_SIZE if seconds_per_size is None else seconds_per_size
    verify, spread, ci, counts, unstable = {}, {}, {}, {}, []
    started = time.perf_counter()
    for n in sorted({int(n) for n in verify_tokens} | {1}):
        timing = timed_ms(step(n), device, repeats, setup=fresh_cache, budget_s=cap)
        key = str(n)
        verify[key], spread[key], ci[key], counts[key] = (timing["ms"], [timing["min_ms"], timing["max_ms"]],
                                                          timing["ci95_ms"], timing["repeats"])
        if not timing["stable"]:
            unstable.append(n)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log.info("target step profile: %d sizes in %.1f s; T_AR %.2f ms", len(verify), time.perf_counter() - started,
             verify["1"])
    if unstable:
        log.warning("target step profile: %d of %d sizes did not reach a median within ±2%% (95%% CI) in %g s each "
                    "(%s tokens): their estimates are less certain than that", len(unstable), len(verify), cap,
                    ", ".join(map(str, unstable)))
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or []
    return {"source": "measured at extraction (dflash-eval extract/profile.py)", "device": name,
            "context_tokens": context_tokens, "repeats": repeats, "seconds_per_size": cap,
            "t_ar_ms": verify["1"], "t_verify_ms": verify, "hybrid": "linear_attention" in layer_types,
            "spread": {"t_verify_ms": spread, "ci95_ms": ci, "repeats": counts, "unstable": unstable,
                       "note": "min and max of the repeats; distribution-free 95% CI of the median; a size is "
                               "unstable where its CI was wider than ±2% when the time cap stopped it"},
            "torch": torch.__version__}


def write_target_profile(model: torch.nn.Module, out: str | Path, options: dict[str, Any]) -> Path | None:
    """Measure and write `serving_profile.json` into the cache directory; a failure only warns."""
    if not wanted(options, next(model.parameters()).device):
        return None
    path = Path(out) / PROFILE_NAME
    try:
        profile = measure_target(model, int(options["context_tokens"]), int(options["repeats"]),
                                 sizes_to_measure(options))
    except Exception as error:  # noqa: BLE001  the cache is what took hours: a profile is never worth losing it
        log.warning("no serving profile: timing the target failed (%s: %s)", type(error).__name__, error)
        return None
    previous = _previous(path, profile)
    if previous is not None:  # the same target on the same device, measured before: does it repeat?
        profile["previous"] = compare(previous["t_verify_ms"], profile["t_verify_ms"], f"serving profile {path}")
    atomic_write_json(path, profile)
    return path


def _previous(path: Path, profile: dict[str, Any]) -> dict[str, Any] | None:
    """The profile already at `path` if it timed the same device at the same context (else no comparison)."""
    if not path.is_file():
        return None
    try:
        old = load_profile(path)
    except Exception:  # noqa: BLE001  an unreadable old profile is replaced, not compared
        return None
    if old.get("device") != profile["device"] or old.get("context_tokens") != profile["context_tokens"]:
        return None
    return {**old, "t_verify_ms": {str(n): ms for n, ms in old["t_verify_ms"].items()}}
