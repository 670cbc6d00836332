"""Time one serving step of the target, T_AR and T_verify(n), for the profile_target rule (tools/profile_target.py).

Batch 1 over a prefilled KV cache, each size n a forward of n tokens, the way servers run decode where we can:
`graphs` on CUDA for a pure-attention or a Gated DeltaNet hybrid target (static caches, each size a CUDA graph; a
hybrid's verify includes its state commit), else `eager` (HF's forward). Each size repeats until its median is
stable or a time cap is spent; only the sizes the configured methods verify are timed (`sizes_to_measure`).
The methods, the caps and the profile written: docs/speedup.md ("measured by us"); the forwards:
docs/speedup_loops.md.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_eval.cache.serving_profile import load_profile
from dflash_eval.extract.backends import gdn_kernels
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.speedup.forwards.graphs import capture
from dflash_eval.speedup.forwards.hybrid_target import StaticHybridTarget, hybrid_unsupported
from dflash_eval.speedup.forwards.target import StaticTarget, static_unsupported
from dflash_eval.speedup.timing import compare, timed_ms

log = logging.getLogger(__name__)

CHAIN_BLOCKS = range(2, 17)  # every chain block of a drafter of block <= 16: where a drafter's own block is unknown
SECONDS_PER_SIZE = 4.0  # past this a size stops repeating, unstable (said in the profile)
TOTAL_SECONDS = 90.0  # all sizes' repeats together: later sizes get what is left, shared evenly (at least 3 calls)


def chain_blocks(block_sizes: list[int] | str | None, own: int) -> set[int]:
    """The chain blocks a drafter of block `own` is evaluated at: its own, and evaluation.block_sizes that fit
    ('all': 2..own); evaluate/stage.py's requested_block_sizes rule (not imported: a change to evaluation's code
    must not re-time the target; tests/tools/test_target_timing.py holds the two equal)."""
    if block_sizes == "all":
        return set(range(2, own + 1))
    return {int(b) for b in block_sizes or [] if int(b) <= own} | {own}


def sizes_to_measure(options: dict[str, Any]) -> list[int]:
    """1 (T_AR), every chain block the configured drafters are evaluated at, N + 1 per DDTree budget: the sizes the
    configured methods verify, no others.

    `options`: `block_sizes` and `ddtree_budgets` (evaluation's), `drafter_blocks` (each configured drafter's own
    block; None where one is not known: then every block 2..16 and the listed block_sizes, as a drafter might
    have)."""
    blocks, own = options.get("block_sizes"), options.get("drafter_blocks")
    if own:
        chains = set().union(*(chain_blocks(blocks, int(b)) for b in own))
    else:
        chains = set(CHAIN_BLOCKS) | ({int(b) for b in blocks} if isinstance(blocks, list) else set())
    # N + 1, methods.TREE.verified's rule (not imported, as above; tests/tools/test_target_timing.py holds it)
    trees = {int(n) + 1 for n in options.get("ddtree_budgets") or []}
    return sorted({1} | chains | trees)


DEFAULT_VERIFY_TOKENS = sizes_to_measure({"ddtree_budgets": [8, 16, 32, 64, 128, 256, 512, 1024]})


def timing_method(model: torch.nn.Module) -> tuple[str, str]:
    """(`graphs` or `eager`, why): graphs where the static cache runs the target's architecture on CUDA."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return "eager", "no CUDA graphs on this device"
    if _is_hybrid(model):
        why = hybrid_unsupported(model)
        return (
            ("eager", why)
            if why
            else (
                "graphs",
                "a Gated DeltaNet hybrid on CUDA: a static cache and static "
                "GDN states (extraction's kernels), one CUDA graph per size",
            )
        )
    why = static_unsupported(model)
    return ("eager", why) if why else ("graphs", "pure attention on CUDA: a static cache, one CUDA graph per size")


def _is_hybrid(model: torch.nn.Module) -> bool:
    return "linear_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or [])


def target_identity(model: torch.nn.Module) -> str:
    """What makes two profiles comparable: the model's name or path and a hash of its config."""
    config = model.config
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    return f"{name} config sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _eager_steps(model: torch.nn.Module, ids: torch.Tensor, context: int):
    """step(n) -> (call, setup): the HF forward over a fresh copy (setup) of a DynamicCache prefilled with
    `context` tokens."""
    from transformers import DynamicCache

    prefilled = DynamicCache(config=model.config)
    model(ids[:, :context], past_key_values=prefilled, use_cache=True)
    cache = [prefilled]

    def fresh_cache() -> None:
        cache[0] = copy.deepcopy(prefilled)

    def step(n: int) -> tuple[Callable[[], None], Callable[[], None] | None]:
        positions = torch.arange(context, context + n, device=ids.device)[None]

        def forward() -> None:
            model(
                ids[:, context : context + n],
                position_ids=positions,
                past_key_values=cache[0],
                use_cache=True,
                logits_to_keep=n,
            )

        return forward, fresh_cache

    return step


def _static_steps(model: torch.nn.Module, ids: torch.Tensor, context: int, graphs: bool, backend: str | None):
    """step(n): n tokens at context.. over a static cache prefilled with `context` tokens, a CUDA graph's replay
    (`graphs`) or the same forward eagerly. Each call rewrites the same n cache rows: no copy between calls."""
    width = -(-(ids.shape[1]) // 64) * 64
    hybrid = _is_hybrid(model)
    target = (
        StaticHybridTarget(model, width, gdn_kernels(backend, next(model.parameters()).device))
        if hybrid
        else StaticTarget(model, width)
    )
    device = target.device
    target.forward(ids[:, :context], torch.zeros(1, dtype=torch.long, device=device), features=False)
    start = torch.full((1,), context, dtype=torch.long, device=device)
    nothing_kept = torch.zeros(1, dtype=torch.long, device=device)

    def step(n: int) -> tuple[Callable[[], None], None]:
        span = min(width, -(-(context + n) // 64) * 64)
        if not hybrid:
            return capture(
                lambda: target.forward(ids[:, context : context + n], start, features=False, span=span), device, graphs
            ), None
        target.drop_records()  # the last size's graph is gone (measure_target deletes it before the next size)
        if n == 1:  # as the validated loop: a decode step advances the states
            return capture(
                lambda: target.forward(ids[:, context : context + n], start, features=False, span=span), device, graphs
            ), None
        target.prepare(n)

        def verify() -> None:  # a verify records, and the commit keeps none of it (see above)
            target.forward(ids[:, context : context + n], start, features=False, span=span, commit=False)
            target.keep(nothing_kept, n)

        return capture(verify, device, graphs), None

    return step


@torch.inference_mode()
def measure_target(
    model: torch.nn.Module,
    context_tokens: int,
    repeats: int,
    verify_tokens: Sequence[int] = DEFAULT_VERIFY_TOKENS,
    seed: int = 0,
    seconds_per_size: float | None = None,
    method: str | None = None,
    total_seconds: float | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """The target's step profile: t_ar_ms (= T_verify(1)), t_verify_ms per n, their spread and CIs.
    `method`: `graphs`, `static` (the graphs' static cache run eagerly: their code path on a CPU) or `eager`;
    default timing_method's choice. `backend`: a hybrid's Gated DeltaNet kernels on the static path (`fla` or
    `torch`, extraction's; None: fla on CUDA, torch elsewhere); the eager path runs whatever is bound."""
    device = next(model.parameters()).device
    chosen, why = timing_method(model)
    if method is not None and method != chosen:
        why = "asked"
    method = method or chosen
    if method not in ("graphs", "static", "eager"):
        raise ValueError(f"profile timing method {method!r}: one of graphs, static, eager")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    sizes = sorted({int(n) for n in verify_tokens} | {1})
    ids = torch.randint(0, vocab, (1, context_tokens + max(sizes)), generator=generator).to(device)
    cap = SECONDS_PER_SIZE if seconds_per_size is None else seconds_per_size
    total = TOTAL_SECONDS if total_seconds is None else total_seconds
    started = time.perf_counter()
    step = (
        _eager_steps(model, ids, context_tokens)
        if method == "eager"
        else _static_steps(model, ids, context_tokens, graphs=method == "graphs", backend=backend)
    )
    verify, spread, ci, counts, unstable = {}, {}, {}, {}, []
    timing_s = 0.0
    for i, n in enumerate(sizes):
        share = max(0.0, total - timing_s) / (len(sizes) - i)  # what is left of the total, shared by the sizes left
        run, setup = step(n)
        began = time.perf_counter()
        timing = timed_ms(run, device, repeats, setup=setup, budget_s=min(cap, share))
        timing_s += time.perf_counter() - began
        del run  # a graph's memory pool goes with it
        key = str(n)
        verify[key], spread[key], ci[key], counts[key] = (
            timing["ms"],
            [timing["min_ms"], timing["max_ms"]],
            timing["ci95_ms"],
            timing["repeats"],
        )
        if not timing["stable"]:
            unstable.append(n)
    wall = time.perf_counter() - started
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log.info("target step profile (%s): %d sizes in %.1f s; T_AR %.3f ms", method, len(verify), wall, verify["1"])
    if unstable:
        log.warning(
            "target step profile: %d of %d sizes did not reach a median within ±2%% (95%% CI) within their "
            "cap (%g s each, %g s in all) (%s tokens): their estimates are less certain than that",
            len(unstable),
            len(verify),
            cap,
            total,
            ", ".join(map(str, unstable)),
        )
    layer_types = getattr(getattr(model, "config", None), "layer_types", None) or []
    return {
        "source": "measured by the profile_target rule (dflash-eval profile-target)",
        "device": name,
        "target": target_identity(model),
        "method": method,
        "method_why": why,
        "context_tokens": context_tokens,
        "repeats": repeats,
        "seconds_per_size": cap,
        "total_seconds": total,
        "wall_s": wall,
        "t_ar_ms": verify["1"],
        "t_verify_ms": verify,
        "hybrid": "linear_attention" in layer_types,
        "verify_includes_state_commit": "linear_attention" in layer_types and method != "eager",
        "spread": {
            "t_verify_ms": spread,
            "ci95_ms": ci,
            "repeats": counts,
            "unstable": unstable,
            "note": "min and max of the repeats; distribution-free 95% CI of the median; a size is "
            "unstable where its CI was wider than ±2% when a time cap stopped it",
        },
        "torch": torch.__version__,
    }


def write_target_profile(model: torch.nn.Module, path: str | Path, options: dict[str, Any]) -> dict[str, Any]:
    """Measure the target and write its profile to `path`; a graph timing that fails is timed eagerly, saying
    why. Returns the profile written."""
    measure = functools.partial(
        measure_target,
        model,
        int(options["context_tokens"]),
        int(options["repeats"]),
        sizes_to_measure(options),
        backend=options.get("kernel_backend"),
    )
    try:
        profile = measure()
    except Exception as error:  # noqa: BLE001  a failed graph timing is timed eagerly instead, saying why
        if timing_method(model)[0] != "graphs":
            raise
        log.warning(
            "the graph-timed profile failed (%s: %s); timing the target eagerly instead", type(error).__name__, error
        )
        profile = measure(method="eager")
        profile["method_why"] = f"the graph timing failed: {type(error).__name__}: {error}"
    path = Path(path)
    previous = _previous(path, profile)
    if previous is not None:  # the same target on the same device, measured before: does it repeat?
        profile["previous"] = {
            **compare(
                previous["t_verify_ms"],
                profile["t_verify_ms"],
                f"serving profile {path} (against the one it replaces, found there)",
            ),
            "found_at": str(path),
            "method": previous.get("method"),
        }
    profile.update(options.get("stamps") or {})
    atomic_write_json(path, profile)
    return profile


def _previous(path: Path, profile: dict[str, Any]) -> dict[str, Any] | None:
    """The profile already at `path` if it timed the same target (when it says which) on the same device at the
    same context (else no comparison)."""
    if not path.is_file():
        return None
    try:
        old = load_profile(path)
    except Exception:  # noqa: BLE001  an unreadable old profile is replaced, not compared
        return None
    if old.get("device") != profile["device"] or old.get("context_tokens") != profile["context_tokens"]:
        return None
    if old.get("target") not in (None, profile["target"]):
        return None
    return {**old, "t_verify_ms": {str(n): ms for n, ms in old["t_verify_ms"].items()}}
