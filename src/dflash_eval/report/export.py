"""`dflash-eval export`: what users hand on from one evaluation, written beside its metrics.json.

- speculation_profile.json (report/speculation_profile.py): per-position acceptance for deployment simulators;
- record.json: one reproducible record of the evaluation: its numbers, the versions that made them (this tool,
  torch, transformers, fla, dflash as extraction recorded them and as installed here, the server's), the settings
  the workflow passed, the seeds, and the identity (sha256) of every input and output, so that a second team can
  rerun the same evaluation and compare. `--check RECORD` re-reads a record and checks it against the files it
  names (the run's own outputs): the numbers against metrics.json, every sha256 against the file.

Both are made from files the evaluation already wrote; nothing is recomputed from the model.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import platform
from pathlib import Path
from typing import Any

from dflash_eval import __version__
from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.completions import read_completions
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json, read_json_object, sha256_file
from dflash_eval.methods import REJECTION, TARGET_ONLY
from dflash_eval.report import speculation_profile

log = logging.getLogger(__name__)

RECORD_FORMAT = "dflash-eval evaluation record 1"
RECORD_FILE = "record.json"  # beside metrics.json (workflow/rules/report.smk's RECORD)
# the distributions whose versions can change the numbers (import names differ: fla is flash-linear-attention)
DISTRIBUTIONS = ("dflash-eval", "torch", "transformers", "flash-linear-attention", "dflash", "numpy", "safetensors")
# metrics.json's own numbers; the expected speedup is not one of them: the report makes it with the target's
# profile (report/speedup.py), so a re-timed target reruns no export either
NUMBER_KEYS = ("tau_mean_of_samples", "tau_token_weighted", "ci95", "samples", "steps", "tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--settings",
        help="JSON: context_buckets, bootstrap, seed, and the settings to record "
        "(evaluate, fetch), as the workflow passes them",
    )
    parser.add_argument("--metrics", help="the evaluation's metrics.json")
    parser.add_argument("--samples", help="its samples.csv (default: beside metrics.json)")
    parser.add_argument("--completions", help="the completions JSONL it evaluated")
    parser.add_argument("--hidden", help="the hidden-state cache it read (default: metrics.json's cache.dir)")
    parser.add_argument("--profile", help="output: speculation_profile.json")
    parser.add_argument("--record", help="output: record.json")
    parser.add_argument(
        "--check",
        metavar="RECORD",
        help="re-read a record.json and check it against the files it "
        "names (relative paths: from the project directory, as "
        "the workflow wrote them); exit 1 and list what differs",
    )


def installed_versions() -> dict[str, str]:
    """This process's versions of the distributions that can change the numbers, where installed."""
    found = {"python": platform.python_version(), "dflash_eval": __version__}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def numbers(metrics: dict) -> dict:
    """The evaluation's headline numbers per method (and the rejection scheme's, where it ran)."""
    out = {TARGET_ONLY: {m: {k: v[k] for k in NUMBER_KEYS if k in v} for m, v in metrics["methods"].items()}}
    rejection = (metrics.get(REJECTION) or {}).get("methods") or {}
    if rejection:
        out[REJECTION] = {m: {k: v[k] for k in NUMBER_KEYS if k in v} for m, v in rejection.items()}
    return out


def _file(path: str | Path) -> dict:
    return {"path": str(path), "sha256": sha256_file(path)}


def server_identity(records: list[dict]) -> dict:
    """The server(s) the completions came from: model path, weight version, speculative settings, version."""
    seen: dict[str, dict] = {}
    for record in records:
        server = record.get("server") or {}
        speculative = server.get("speculative") or {}
        identity = {
            "model": server.get("model"),
            "model_path": server.get("model_path"),
            "weight_version": server.get("weight_version"),
            "version": speculative.get("version"),
            "speculative": speculative or None,
        }
        seen.setdefault(json.dumps(identity, sort_keys=True), identity)
    servers = list(seen.values())
    return servers[0] if len(servers) == 1 else {"several": servers}


def seeds(settings: dict, records: list[dict]) -> dict:
    """Every seed that decides a number: the bootstrap's, the dataset subset's, each sampled completion's."""
    fetch = settings.get("fetch") or {}
    drawn = sorted(
        {
            r["sampling"]["seed"]
            for r in records
            if isinstance(r.get("sampling"), dict) and r["sampling"].get("seed") is not None
        }
    )
    return {
        "bootstrap_seed": settings["seed"],
        "bootstrap_resamples": settings["bootstrap"],
        "dataset_subset_seed": fetch.get("seed"),
        "max_samples": fetch.get("max_samples"),
        "sampling_seed": fetch.get("sampling_seed"),
        "completion_sampling_seeds": drawn or None,
    }


def build_record(
    metrics_path: Path, samples_path: Path, completions: Path, hidden: Path, profile_path: Path, settings: dict
) -> dict:
    """The record of one evaluation (see the module's docstring); the profile must be written already."""
    metrics = read_json_object(metrics_path)
    manifest = cache_manifest.read(hidden) or {}
    records = read_completions(completions)
    cache = metrics["cache"]
    return {
        "format": RECORD_FORMAT,
        "drafter": metrics["drafter"],
        "dataset": metrics["dataset"],
        "numbers": numbers(metrics),
        "versions": {
            "exported_with": installed_versions(),
            "extraction": (manifest.get("backend") or {}),
            "server": server_identity(records),
        },
        "settings": {
            "evaluate": settings.get("evaluate"),
            "fetch": settings.get("fetch"),
            "evaluation": {
                "device": metrics.get("device"),
                "dtype": metrics.get("dtype"),
                "verify": metrics.get("verify"),
                "block_size": metrics["block_size"],
                "layer_ids": metrics["layer_ids"],
                "stop_token_ids": metrics.get("stop_token_ids"),
                "sampling": metrics.get("sampling"),
            },
        },
        "seeds": seeds(settings, records),
        "inputs": {
            "completions": _file(completions),
            "checkpoint": {k: metrics["checkpoint"].get(k) for k in ("path", "layout", "sha256", "global_step")},
            "target": {
                "path": (manifest.get("target") or {}).get("path"),
                "config_hash": cache.get("target_config_hash"),
            },
            "hidden_cache": {
                "dir": str(hidden),
                "backend": cache.get("backend"),
                "completions_sha256": (manifest.get("completions") or {}).get("sha256"),
                "shards": [{"file": s["file"], "sha256": s["sha256"]} for s in cache.get("shards_verified") or []],
            },
        },
        "outputs": {
            "metrics": _file(metrics_path),
            "samples": _file(samples_path),
            "speculation_profile": _file(profile_path),
        },
    }


def check_record(path: str | Path) -> list[str]:
    """What in a record no longer matches the files it names: every sha256, and its numbers against metrics.json."""
    record = read_json_object(path)
    if record.get("format") != RECORD_FORMAT:
        return [f"{path}: format {record.get('format')!r}, not {RECORD_FORMAT!r}"]
    problems = []
    files = [*record["outputs"].values(), record["inputs"]["completions"]]
    for entry in files:
        file = Path(entry["path"])
        if not file.is_file():
            problems.append(f"{file}: named by {path} but not there")
        elif sha256_file(file) != entry["sha256"]:
            problems.append(f"{file}: sha256 differs from the one {path} recorded")
    metrics_file = Path(record["outputs"]["metrics"]["path"])
    if metrics_file.is_file():
        metrics = read_json_object(metrics_file)
        for scheme, methods in numbers(metrics).items():
            for method, values in methods.items():
                kept = record["numbers"].get(scheme, {}).get(method)
                if kept is None or not _same(kept, values):
                    problems.append(f"{path}: {scheme} {method}'s numbers differ from {metrics_file}'s")
        if record["inputs"]["checkpoint"]["sha256"] != metrics["checkpoint"].get("sha256"):
            problems.append(f"{path}: checkpoint sha256 differs from {metrics_file}'s")
    return problems


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON keeps them (NaN is written as null)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    nan = lambda v: v is None or (isinstance(v, float) and math.isnan(v))
    return (nan(a) and nan(b)) or a == b


def lines() -> list[str]:
    """summary.md's pointer to what each evaluation hands on (the rows' speculation_profile column names each)."""
    return [
        "## Handed on",
        "",
        f"Beside each evaluation's metrics.json: `{speculation_profile.FILE}` (conditional and marginal "
        "acceptance per draft position, the histogram and tau per method and context length, for deployment "
        f"simulators; summary.csv's speculation_profile column) and `{RECORD_FILE}` (numbers, versions, "
        "settings, seeds and input identities; `dflash-eval export --check` re-reads one against the files it "
        "names).",
    ]


def run(args: argparse.Namespace) -> int:
    if args.check:
        problems = check_record(args.check)
        for problem in problems:
            log.error("%s", problem)
        if not problems:
            log.info("%s matches the files it names", args.check)
        return 1 if problems else 0
    missing = [flag for flag in ("settings", "metrics", "completions", "profile", "record") if not getattr(args, flag)]
    if missing:
        raise DflashEvalError(f"dflash-eval export needs --{', --'.join(missing)} (or --check RECORD)")
    settings = json.loads(args.settings)
    metrics_path = Path(args.metrics)
    samples_path = Path(args.samples) if args.samples else metrics_path.with_name("samples.csv")
    metrics = read_json_object(metrics_path)
    hidden = Path(args.hidden or metrics["cache"]["dir"])
    profile = speculation_profile.build(
        metrics,
        speculation_profile.read_samples(samples_path),
        settings,
        cache_manifest.read(hidden),
        str(metrics_path),
    )
    atomic_write_json(args.profile, profile)
    atomic_write_json(
        args.record,
        build_record(metrics_path, samples_path, Path(args.completions), hidden, Path(args.profile), settings),
    )
    log.info(
        "%s on %s: speculation profile %s, record %s", metrics["drafter"], metrics["dataset"], args.profile, args.record
    )
    return 0
