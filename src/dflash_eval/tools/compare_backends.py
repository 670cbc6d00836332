"""`dflash-eval compare-backends`: the same samples through both Gated DeltaNet kernel backends.

A drafter trained on states from one implementation (fla's Triton kernels, usually) sees slightly
different inputs when the cache comes from the other (transformers' torch fallback). This command
measures by how much, layer by layer (per-token cosine, relative L2, max abs error), and, given a
drafter, what that does to tau. The reference for the error figures is the second backend named
(default `torch`, the plain PyTorch reading of the math).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from dflash_eval.config import drafter_default
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.backends import BACKENDS, select_backend, use_backend
from dflash_eval.extract.capture import (
    LAST_LAYER,
    capture_layers,
    check_layer_ids,
    text_parts,
)
from dflash_eval.extract.target import DTYPES
from dflash_eval.io_utils import atomic_write_json

log = logging.getLogger(__name__)


@dataclass
class LayerError:
    """Running error statistics of one layer: candidate backend against the reference backend."""

    layer: int
    tokens: int = 0
    cos_sum: float = 0.0
    cos_min: float = math.inf
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0

    def add(self, candidate: torch.Tensor, reference: torch.Tensor) -> None:
        """Accumulate one sample's [T, H] states (compared in float32)."""
        a, b = candidate.float(), reference.float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        self.tokens += a.shape[0]
        self.cos_sum += float(cos.sum())
        self.cos_min = min(self.cos_min, float(cos.min()))
        self.diff_sq += float((a - b).pow(2).sum())
        self.ref_sq += float(b.pow(2).sum())
        self.max_abs = max(self.max_abs, float((a - b).abs().max()))

    def summary(self) -> dict[str, float | int]:
        return {
            "layer": self.layer,
            "tokens": self.tokens,
            "cos_mean": self.cos_sum / self.tokens,
            "cos_min": self.cos_min,
            "rel_l2": math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else 0.0,
            "max_abs": self.max_abs,
        }


@dataclass
class DrafterCheck:
    """What evaluating a drafter on both backends' states needs."""

    runner: Any  # dflash_eval.evaluate.blocks.BlockDrafter on the comparison device
    layer_ids: list[int]  # the drafter's target layers, in its order
    prompt_lens: Sequence[int]
    stop_ids: set[int]
    max_tokens: Sequence[int | None]


@dataclass
class DrafterAgreement:
    """A drafter's acceptance lengths on each backend's states (chain, its own block)."""

    steps: dict[str, list[int]] = field(default_factory=dict)
    samples_differing: int = 0

    def tau(self, backend: str) -> float:
        steps = self.steps.get(backend, [])
        return sum(steps) / len(steps) if steps else float("nan")


def _states_per_backend(
    model: torch.nn.Module,
    tokens: Sequence[torch.Tensor],
    layer_ids: list[int],
    backends: Sequence[str],
    device: torch.device,
    last_layer: str,
) -> dict[str, list[dict[int, torch.Tensor]]]:
    """Every sample's layer states under each backend, kept on the host (one backend at a time)."""
    out: dict[str, list[dict[int, torch.Tensor]]] = {}
    for name in backends:
        with use_backend(name, device, model) as run:
            kept = []
            for ids in tqdm(tokens, desc=f"forward with {name}", unit="sample"):
                captured = capture_layers(model, layer_ids, ids.to(device), want_argmax=False, last_layer=last_layer)
                kept.append({i: s.cpu() for i, s in captured.states.items()})
            info = run.verify()
        log.info("backend %s ran %s", name, info.implementation)
        out[name] = kept
    return out


def compare_backends(
    model: torch.nn.Module,
    tokens: Sequence[torch.Tensor],
    layer_ids: Sequence[int],
    device: str | torch.device,
    backends: Sequence[str] = ("fla", "torch"),
    drafter: DrafterCheck | None = None,
    last_layer: str | None = None,
) -> dict[str, Any]:
    """Per-layer errors of backends[0] against backends[1] on `tokens` (one [T] tensor per sample).

    `last_layer` is what the target's last layer id holds, as `drafters.<name>.last_layer` says (None: the
    schema's default).

    With `drafter` each backend's states are also evaluated (chain, the drafter's own block) and
    tau per backend is reported.
    """
    if len(backends) != 2 or len(set(backends)) != 2 or any(b not in BACKENDS for b in backends):
        raise DflashEvalError(f"compare-backends needs two different backends out of {BACKENDS}, got {list(backends)}")
    device = torch.device(device)
    decoder, _ = text_parts(model)
    layer_ids = check_layer_ids(layer_ids, len(decoder.layers))
    if drafter is not None and set(drafter.layer_ids) - set(layer_ids):
        raise DflashEvalError(
            f"layers {sorted(set(drafter.layer_ids) - set(layer_ids))} that the drafter reads "
            f"are not among the compared layers {layer_ids}"
        )
    last_layer = last_layer or drafter_default("last_layer")
    states = _states_per_backend(model, tokens, layer_ids, backends, device, last_layer)
    candidate, reference = backends
    errors = {i: LayerError(i) for i in layer_ids}
    for got, want in zip(states[candidate], states[reference]):
        for i in layer_ids:
            errors[i].add(got[i], want[i])
    result: dict[str, Any] = {
        "candidate": candidate,
        "reference": reference,
        "samples": len(tokens),
        "tokens": sum(len(t) for t in tokens),
        "layers": [errors[i].summary() for i in layer_ids],
    }
    if drafter is not None:
        result["drafter"] = _drafter_taus(drafter, tokens, states, backends, device)
    return result


def _drafter_taus(
    check: DrafterCheck,
    tokens: Sequence[torch.Tensor],
    states: dict[str, list[dict[int, torch.Tensor]]],
    backends: Sequence[str],
    device: torch.device,
) -> dict[str, Any]:
    from dflash_eval.evaluate.acceptance import sequence_limits
    from dflash_eval.evaluate.all_anchor import evaluate_sample
    from dflash_eval.methods import chain_method

    runner = check.runner
    block = runner.block_size
    method = chain_method(block)
    agreement = DrafterAgreement()
    dtype = next(runner.parameters()).dtype
    for index, ids in enumerate(tokens):
        ids = ids.to(device)
        limits = sequence_limits(
            check.prompt_lens[index], len(ids), check.max_tokens[index], int(ids[-1]) in check.stop_ids
        )
        per_backend = []
        for name in backends:
            per_layer = states[name][index]
            features = torch.cat([per_layer[i] for i in check.layer_ids], dim=-1).to(device=device, dtype=dtype)
            steps = evaluate_sample(runner, features, ids, limits, check.stop_ids, [block], [], [], 64).steps[method]
            agreement.steps.setdefault(name, []).extend(steps)
            per_backend.append(steps)
        agreement.samples_differing += per_backend[0] != per_backend[1]
    taus = {name: agreement.tau(name) for name in backends}
    return {
        "method": method,
        "tau": taus,
        "tau_difference": taus[backends[0]] - taus[backends[1]],
        "samples_differing": agreement.samples_differing,
    }


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of a compare_backends result."""
    lines = [
        f"{result['candidate']} against {result['reference']}: {result['samples']} samples, {result['tokens']} tokens",
        "",
        "| layer | cos mean | cos min | rel L2 | max abs |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['layer']} | {r['cos_mean']:.6f} | {r['cos_min']:.6f} | {r['rel_l2']:.2e} | {r['max_abs']:.3g} |"
        for r in result["layers"]
    ]
    if "drafter" in result:
        d = result["drafter"]
        taus = ", ".join(f"{name} {tau:.3f}" for name, tau in d["tau"].items())
        lines += [
            "",
            f"drafter {d['method']}: tau {taus}; difference {d['tau_difference']:+.3f}; "
            f"{d['samples_differing']} of {result['samples']} samples with different steps",
        ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target checkpoint directory")
    parser.add_argument("--completions", required=True, help="completions JSONL (the fetch stage's output)")
    parser.add_argument("--layers", required=True, help="comma-separated layer ids, e.g. 1,16,31,46,61")
    parser.add_argument("--device", default="cuda:0", help="fla needs a CUDA device")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(DTYPES),
        help="dtype the target runs in on both backends (default bfloat16, what training uses)",
    )
    parser.add_argument("--backends", default="fla,torch", help="candidate,reference")
    parser.add_argument("--max-samples", type=int, default=16, help="first N completions (0: all)")
    parser.add_argument("--drafter", help="optional drafter checkpoint: also report tau on each backend's states")
    parser.add_argument("--drafter-config", help="config.json for a .pt drafter")
    parser.add_argument(
        "--last-layer",
        choices=LAST_LAYER,
        default=None,
        help="what the target's last layer id holds (drafters.<name>.last_layer; default: the schema's)",
    )
    parser.add_argument("--out", help="write the result as JSON here")


def run(args: argparse.Namespace) -> int:
    from dflash_eval.completions import read_completions
    from dflash_eval.evaluate.blocks import BlockDrafter
    from dflash_eval.evaluate.drafter import load_drafter
    from dflash_eval.evaluate.stage import stop_token_ids
    from dflash_eval.extract.stage import parse_layers
    from dflash_eval.extract.target import load_target

    backends = tuple(args.backends.split(","))
    for name in backends:
        select_backend(name, args.device)  # a backend that cannot run here fails before the model loads
    records = read_completions(args.completions, need_tokens=True)
    if args.max_samples:
        records = records[: args.max_samples]
    layer_ids = parse_layers(args.layers)
    model, _ = load_target(args.target, args.dtype, args.device)
    check = None
    if args.drafter:
        loaded = load_drafter(args.drafter, config=args.drafter_config)
        _, lm_head = text_parts(model)
        runner = BlockDrafter(
            loaded.model, model.get_input_embeddings().weight.detach(), lm_head.weight.detach(), loaded.mask_token_id
        ).to(device=args.device, dtype=model.dtype)
        check = DrafterCheck(
            runner,
            list(loaded.layer_ids),
            [len(r["prompt_token_ids"]) for r in records],
            set(stop_token_ids({"target": {"path": args.target}})),
            [r.get("request", {}).get("max_tokens") for r in records],
        )
    tokens = [torch.tensor(r["prompt_token_ids"] + r["completion_token_ids"]) for r in records]
    result = compare_backends(
        model, tokens, layer_ids, args.device, backends, drafter=check, last_layer=args.last_layer
    )
    result.update(target=str(args.target), dtype=args.dtype, device=args.device, completions=str(args.completions))
    print(format_table(result))
    if args.out:
        atomic_write_json(args.out, result)
    return 0
