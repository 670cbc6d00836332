"""The live loop, timed: `dflash.model.dflash_generate` (batch 1, temperature 0) against the target's own
autoregressive greedy loop, on the same stack, for the measured side of the speedup's validation.

The autoregressive loop is the reference loop itself at block size 1 (no drafter call: one target token per
step, the same cache, the same host sync per step), so the two differ only in speculation. Speedup = decode
time of that loop / decode time of the speculative loop for the same number of new tokens (no stop tokens,
so both produce exactly `max_new_tokens`); prefill is outside both (dflash_generate times it apart).
A hybrid (Gated DeltaNet) target runs with exact rollback (demo/reference.py: a snapshot per verify and a
replay of the kept tokens after a partial acceptance, which transformers' crop cannot undo); the replay
is part of the measured step, as it is of this stack's loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from dflash_eval.demo.reference import exact_target_rollback
from dflash_eval.speedup.live_loops.run import LoopRun
from dflash_eval.speedup.simulate import forced_acceptance


def is_hybrid(target: torch.nn.Module) -> bool:
    """A target with linear-attention (Gated DeltaNet) layers: its cache cannot be cropped exactly."""
    return "linear_attention" in (getattr(target.config, "layer_types", None) or [])


@contextmanager
def _host_clock_on_cpu(device: torch.device) -> Iterator[None]:
    """dflash_generate's timers call torch.cuda.synchronize; on a CPU they are plain perf_counter."""
    import dflash.model as reference

    original = reference._cuda_time
    if device.type != "cuda":
        reference._cuda_time = time.perf_counter
    try:
        yield
    finally:
        reference._cuda_time = original


def run_loop(
    drafter: torch.nn.Module | None,
    target: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    simulate_tau: float | None = None,
    seed: int = 0,
) -> LoopRun:
    """One timed dflash_generate: block_size 1 is the autoregressive loop (`drafter` unused), otherwise the
    speculative one, with acceptance forced to `simulate_tau` (speedup/simulate.py) when given."""
    import dflash.model as reference

    device = prompt.device
    with ExitStack() as stack:
        stack.enter_context(_host_clock_on_cpu(device))
        if block_size > 1 and is_hybrid(target):
            stack.enter_context(exact_target_rollback(target))
        if block_size > 1 and simulate_tau is not None:
            stack.enter_context(forced_acceptance(target, simulate_tau, seed))
        stats = reference.dflash_generate(
            drafter, target, prompt, max_new_tokens, None, temperature=0.0, block_size=block_size, return_stats=True
        )
    tokens = int(stats.num_output_tokens)
    return LoopRun(stats.time_per_output_token * tokens, tokens, list(stats.acceptance_lengths))


def measured_speedup(autoregressive: LoopRun, speculative: LoopRun) -> float:
    """Wall-clock speedup of the same number of new tokens: the ratio of the two loops' decode times."""
    if autoregressive.new_tokens != speculative.new_tokens:
        raise ValueError(f"the loops produced {autoregressive.new_tokens} and {speculative.new_tokens} tokens")
    return autoregressive.decode_s / speculative.decode_s
