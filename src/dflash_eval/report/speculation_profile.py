"""A speculation profile per drafter, dataset and method: what a deployment simulator needs to know about a drafter.

Simulators (dynamo's mocker, vLLM's synthetic rejection sampler) model a drafter by its per-position acceptance,
not by its mean. The profile carries the marginal and conditional accept rates they read, overall and per
context-length bucket (report.context_buckets), made from the evaluation's own per-step record (samples.csv), so
writing it reruns no evaluation. Its fields follow NVIDIA Model-Optimizer's proposed speculation_profile.json
where they mean the same thing; docs/contracts.md lists every field and which are ours.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_eval import stats
from dflash_eval.completions import prompt_cluster
from dflash_eval.errors import DflashEvalError
from dflash_eval.methods import CHAIN, TARGET_ONLY, is_kind
from dflash_eval.methods import parse as parse_method

FORMAT = "dflash-eval speculation profile 1"
FILE = "speculation_profile.json"  # beside metrics.json (workflow/rules/report.smk's PROFILE)
# where samples.csv's numbers are recomputed, they must equal metrics.json's to this (both are sums of integers)
TOLERANCE = 1e-9
VALIDATION = (
    "offline: greedy drafts verified against the served completion from the target's cached hidden states, "
    "step by step equal to dflash.model.dflash_generate's loop (docs/trust.md)"
)


@dataclass(frozen=True)
class SampleSteps:
    """One sample's verification steps under one method (a samples.csv row)."""

    id: str
    prompt_tokens: int
    steps: tuple[int, ...]

    def contexts(self) -> list[int]:
        """Tokens before each step's block: the prompt and what the earlier steps produced."""
        out, position = [], self.prompt_tokens
        for produced in self.steps:
            out.append(position)
            position += produced
        return out


def read_samples(path: str | Path) -> dict[str, list[SampleSteps]]:
    """method -> its samples, in samples.csv's order (the evaluation's, by id); an error names a bad row."""
    path = Path(path)
    if not path.is_file():
        raise DflashEvalError(
            f"{path} not found; the speculation profile is made from the evaluate stage's "
            "samples.csv: run that evaluation first"
        )
    out: dict[str, list[SampleSteps]] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                steps = tuple(int(x) for x in (row["acceptance_lengths"] or "").split())
                sample = SampleSteps(str(row["id"]), int(row["prompt_tokens"]), steps)
                method = row["method"]
            except (KeyError, TypeError, ValueError) as error:
                raise DflashEvalError(
                    f"{path}:{line}: not a samples.csv row of `dflash-eval evaluate` ({error!r})"
                ) from None
            out.setdefault(method, []).append(sample)
    return out


def position_rates(per_sample: Sequence[Sequence[int]], depth: int) -> dict[str, list[float | None]]:
    """Marginal and conditional acceptance of draft positions 1..depth-1 over every step."""
    marginal = [None if math.isnan(m) else m for m in stats.acceptance_by_position(per_sample, depth)]
    conditional: list[float | None] = []
    previous: float | None = 1.0
    for rate in marginal:
        conditional.append(None if rate is None or not previous else rate / previous)
        previous = rate
    return {"conditional_accept_rates": conditional, "marginal_accept_rates": marginal}


def rates(
    samples: Sequence[SampleSteps], depth: int, n_boot: int, seed: int, sampled: bool, ci95: dict | None = None
) -> dict:
    """The profile's numbers over `samples`: both rates, tau in both conventions with 95% intervals (`ci95`:
    metrics.json's, else the same cluster bootstrap here), the histogram and the counts."""
    per_sample = [list(s.steps) for s in samples]
    tau = stats.tau_stats(per_sample)
    if ci95 is None:
        ci95 = stats.bootstrap_ci(per_sample, n_boot, seed, clusters=[prompt_cluster(s.id, sampled) for s in samples])
    positions = position_rates(per_sample, depth)
    implied = 1 + sum(m for m in positions["marginal_accept_rates"] if m is not None)
    return {
        **positions,
        "mean_accept_length": tau["tau_token_weighted"],
        "mean_accept_length_ci95": list(ci95["tau_token_weighted"]),
        "mean_accept_length_per_request": tau["tau_mean_of_samples"],
        "mean_accept_length_per_request_ci95": list(ci95["tau_mean_of_samples"]),
        "acceptance_length_histogram": stats.histogram(per_sample, depth),
        "num_samples": tau["samples"],
        "num_steps": tau["steps"],
        "num_tokens": tau["tokens"],
        "validation": {
            "mean_consistency": {
                "implied_mean_accept_length": implied if tau["steps"] else None,
                "passed": bool(tau["steps"]) and abs(implied - tau["tau_token_weighted"]) <= TOLERANCE,
            }
        },
    }


def bucket_edges(edges: Sequence[int]) -> list[tuple[int, int | None]]:
    """[0, e1), [e1, e2), ..., [eN, None = no end) from ascending edges (report.context_buckets)."""
    edges = [int(e) for e in edges]
    if any(b <= a for a, b in zip(edges, edges[1:])) or any(e <= 0 for e in edges):
        raise DflashEvalError(f"report.context_buckets must be ascending positive token counts, got {edges}")
    lows = [0, *edges]
    return list(zip(lows, [*edges, None]))


def by_context(
    samples: Sequence[SampleSteps], depth: int, edges: Sequence[int], n_boot: int, seed: int, sampled: bool
) -> list[dict]:
    """The rates per context-length bucket; a bucket no step fell into is left out."""
    out = []
    for low, high in bucket_edges(edges):
        inside = []
        for sample in samples:
            kept = tuple(
                step
                for step, context in zip(sample.steps, sample.contexts())
                if context >= low and (high is None or context < high)
            )
            if kept:
                inside.append(SampleSteps(sample.id, sample.prompt_tokens, kept))
        if inside:
            out.append({"context_tokens": [low, high], **rates(inside, depth, n_boot, seed, sampled)})
    return out


def _check_against_metrics(numbers: dict, recorded: dict, method: str, where: str) -> None:
    """samples.csv and metrics.json are one evaluation's two outputs: a profile from a mismatched pair is refused."""
    for ours, theirs in (
        ("mean_accept_length", "tau_token_weighted"),
        ("mean_accept_length_per_request", "tau_mean_of_samples"),
        ("num_samples", "samples"),
        ("num_steps", "steps"),
        ("num_tokens", "tokens"),
    ):
        if not math.isclose(float(numbers[ours]), float(recorded[theirs]), rel_tol=TOLERANCE, abs_tol=TOLERANCE):
            raise DflashEvalError(
                f"{where}: {method}'s {theirs} is {recorded[theirs]} in metrics.json but "
                f"{numbers[ours]} from samples.csv; they are not one evaluation's outputs: "
                "rerun it (snakemake --forcerun evaluate)"
            )


def method_profile(method: str, samples: Sequence[SampleSteps], metrics: dict, settings: dict, where: str) -> dict:
    """One method's profile: the Model-Optimizer fields, our method name, and the rates by context length."""
    recorded = metrics["methods"][method]
    parsed = parse_method(method)
    depth = parsed.block_size(int(metrics["block_size"]))
    sampled = bool(metrics.get("sampling"))
    numbers = rates(samples, depth, settings["bootstrap"], settings["seed"], sampled, ci95=recorded["ci95"])
    _check_against_metrics(numbers, recorded, method, where)
    chain = is_kind(method, CHAIN.name)
    return {
        "measured": True,
        "method": "dflash" if chain else "ddtree",
        "evaluation_method": method,
        "num_speculative_tokens": depth - 1,
        "block_size": int(metrics["block_size"]),
        "max_supported_k": int(metrics["block_size"]) - 1,
        "tree_budget": parsed.budget,
        "verification_method": "longest_prefix" if chain else "tree",
        "accept_length_model": "measured_per_k",
        **numbers,
        "by_context_length": by_context(
            samples, depth, settings["context_buckets"], settings["bootstrap"], settings["seed"], sampled
        ),
    }


def build(
    metrics: dict, samples: dict[str, list[SampleSteps]], settings: dict, manifest: dict | None, where: str
) -> dict:
    """The profile file of one evaluation: its identities and conditions once, then one profile per method that
    samples.csv holds (the target_only scheme's; metrics.json lists the methods it must hold)."""
    missing = sorted(set(metrics["methods"]) - set(samples))
    if missing:
        raise DflashEvalError(
            f"{where}: samples.csv holds no rows of {', '.join(missing)}, which metrics.json "
            "lists; rerun the evaluation"
        )
    checkpoint, target = metrics["checkpoint"], (manifest or {}).get("target") or {}
    return {
        "format": FORMAT,
        "drafter": metrics["drafter"],
        "dataset": metrics["dataset"],
        "draft_checkpoint": {
            "name": metrics["drafter"],
            "path": checkpoint.get("path"),
            "layout": checkpoint.get("layout"),
            "sha256": checkpoint.get("sha256"),
            "global_step": checkpoint.get("global_step"),
            "layer_ids": metrics["layer_ids"],
        },
        "target_model": {
            "path": target.get("path"),
            "config_hash": metrics["cache"].get("target_config_hash"),
            "model_type": target.get("model_type"),
            "dtype": target.get("dtype"),
            "backend": metrics["cache"].get("backend"),
        },
        "measurement_conditions": {
            "dataset": metrics["dataset"],
            "verification_scheme": TARGET_ONLY,
            "sampling": metrics.get("sampling") or "greedy",
            "evaluation_dtype": metrics.get("dtype"),
            "validation": VALIDATION,
            "context_buckets": list(settings["context_buckets"]),
            "bootstrap": settings["bootstrap"],
            "seed": settings["seed"],
        },
        "profiles": {
            method: method_profile(method, samples[method], metrics, settings, where) for method in metrics["methods"]
        },
    }
