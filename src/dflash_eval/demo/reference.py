"""The reference loop: `dflash.model.dflash_generate` run live, with exact rollback of the hybrid target's
cache. The independent reference that offline tau is tested against; the demo server speculates with it, and
benchmarks/fidelity.py runs it as its live side."""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager, nullcontext

import torch


@contextmanager
def exact_target_rollback(target):
    """Make `dflash_generate`'s target cache rewind exactly after a partial acceptance.

    transformers' `DynamicCache.crop` rewinds attention keys/values and Gated DeltaNet convolution
    states, but not the Gated DeltaNet recurrent states: after a block is verified and partly
    rejected, the live loop's hybrid target keeps the rejected draft tokens in its state and
    verifies every later block against that (tests/evaluate/test_all_anchor.py shows the difference).
    Here every target forward first snapshots the cache; a crop that removes tokens restores the
    snapshot and replays only the kept tokens, which is what an exact server (SGLang keeps
    per-token states for this) computes.
    """
    import dflash.model as reference

    last: dict = {}

    def snapshot(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and not last.get("replaying"):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            last.update(cache=cache, copy=copy.deepcopy(cache), ids=ids, positions=kwargs.get("position_ids"))

    def crop_exactly(cache, length):
        if cache is not last.get("cache") or length >= cache.get_seq_length():
            return original_crop(cache, length)
        saved = last["copy"]
        keep = length - saved.get_seq_length()
        cache.layers = copy.deepcopy(saved.layers)
        if keep > 0:
            last["replaying"] = True
            try:
                positions = last["positions"]
                target(
                    last["ids"][:, :keep],
                    position_ids=None if positions is None else positions[:, :keep],
                    past_key_values=cache,
                    use_cache=True,
                )
            finally:
                last["replaying"] = False
        original_crop(cache, length)

    original_crop = reference._crop_to
    handle = target.register_forward_pre_hook(snapshot, with_kwargs=True)
    reference._crop_to = crop_exactly
    try:
        yield
    finally:
        reference._crop_to = original_crop
        handle.remove()


def run_reference_loop(
    drafter,
    target,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    block_size: int | None = None,
    exact_rollback: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
):
    """Run the reference loop (temperature 0 unless given); returns (acceptance_lengths, output ids).

    At temperature > 0 it is dflash's speculative sampling (drafts from q, accepted with min(1, p/q); top_k 0 is
    off in dflash's spelling), seeded by torch's global generator (the evaluation's rejection scheme tests it).

    `exact_rollback=False` runs it as published, with transformers' inexact hybrid-cache crop. A drafter loaded
    for the evaluation (evaluate.drafter_model's classes) runs as the reference class holding its weights.
    """
    import dflash.model as reference

    from dflash_eval.evaluate.drafter import reference_drafter

    drafter = reference_drafter(drafter)

    original = reference._cuda_time
    reference._cuda_time = time.perf_counter  # the reference synchronises CUDA for its timers
    try:
        with exact_target_rollback(target) if exact_rollback else nullcontext():
            stats = reference.dflash_generate(
                drafter,
                target,
                torch.tensor([prompt_ids], device=target.device),
                max_new_tokens,
                stop_ids,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                block_size=block_size,
                return_stats=True,
            )
    finally:
        reference._cuda_time = original
    return list(stats.acceptance_lengths), stats.output_ids[0].tolist()


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
