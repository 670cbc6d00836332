"""The evaluate stage: one drafter x one dataset, from cached target states to metrics.json and samples.csv.

metrics.json's keys (the report reads them) and samples.csv's rows: docs/contracts.md.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_eval import attention_layout, stats
from dflash_eval.cache import completions_check
from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.checkpoint import (
    agreed_layer_ids,
    check_against_target,
    checkpoint_facts,
)
from dflash_eval.completions import prompt_cluster, read_completions
from dflash_eval.config import verify_schemes
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import (
    acceptance,
    drafter_kind,
    rejection_metrics,
    sampled_check,
)
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.cuda_graphs import graph_options
from dflash_eval.evaluate.draft_timing import time_on_cache as time_drafter_on_cache
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.gpu import claim_device
from dflash_eval.evaluate.speedup import drafter_section
from dflash_eval.evaluate.target_head import load_target_head
from dflash_eval.evaluate.trajectory import (
    EvaluatorOptions,
    LoadedSample,
    SampleSpec,
    TrajectoryEvaluator,
)
from dflash_eval.io_utils import atomic_write_json, atomic_write_text
from dflash_eval.methods import REJECTION, TARGET_ONLY, chain_method
from dflash_eval.methods import parse as parse_method
from dflash_eval.provenance.fingerprint import checkpoint_sha256
from dflash_eval.provenance.stamps import STAMP, stage_stamp

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stop_token_ids(settings: dict) -> list[int]:
    """Explicit ids from config, else the target's generation_config / config eos ids."""
    if settings.get("stop_token_ids"):
        return [int(i) for i in settings["stop_token_ids"]]
    target = Path(settings["target"]["path"])
    for name in ("generation_config.json", "config.json"):
        file = target / name
        if file.exists():
            data = json.loads(file.read_text())
            eos = data.get("eos_token_id", data.get("text_config", {}).get("eos_token_id"))
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
    raise DflashEvalError(
        f"{target}: no eos_token_id in generation_config.json or config.json; set evaluation.stop_token_ids"
    )


def check_last_layer(cache, settings: dict) -> None:
    """A drafter that taps the target's last layer must get there what it was trained on (capture.LAST_LAYER).

    A cache without the record predates it: its hooks kept the layer's own output ("pre_norm").
    """
    checkpoint, target = settings["checkpoint"], cache_manifest.entry(cache.directory, cache.manifest, "target")
    final = int(cache_manifest.entry(cache.directory, cache.manifest, "target.num_hidden_layers")) - 1
    wanted, held = checkpoint["last_layer"], target.get("last_layer", "pre_norm")  # see above: an old cache
    if final in checkpoint["layer_ids"] and wanted != held:
        raise DflashEvalError(
            f"{cache.directory}: drafter {settings['drafter']} taps the target's last layer ({final}) and was trained "
            f"on its {wanted} output, but this cache holds the {held} output there. Set drafters."
            f"{settings['drafter']}.last_layer to what the drafter was trained on (final_norm: what dflash_generate "
            f"feeds; pre_norm: the layer's own output) and re-run extraction for its layer set"
        )


def check_cache(cache, settings: dict) -> dict:
    """The cache must hold the drafter's layers, come from the same target, and the trained backend."""
    from dflash_eval.target_identity import target_config_hash

    checkpoint = settings["checkpoint"]
    if checkpoint.get("layer_ids") is None:  # the checkpoint's own list (headers and config.json only, no weights)
        facts = checkpoint_facts(checkpoint["path"], checkpoint["layout"], checkpoint.get("config"))
        checkpoint = {**checkpoint, "layer_ids": agreed_layer_ids(facts, None)}
        settings = {**settings, "checkpoint": checkpoint}
    missing = [i for i in checkpoint["layer_ids"] if i not in cache.layer_ids]
    if missing:
        raise DflashEvalError(
            f"{cache.directory}: cache lacks layers {missing} that drafter {settings['drafter']} needs"
        )
    check_last_layer(cache, settings)
    expected_hash = target_config_hash(settings["target"]["path"])
    cached_hash = cache_manifest.entry(cache.directory, cache.manifest, "target.config_hash")
    if cached_hash != expected_hash:
        raise DflashEvalError(
            f"{cache.directory}: built from a different target (config hash {cached_hash[:12]}) than "
            f"{settings['target']['path']} ({expected_hash[:12]}); re-run extraction"
        )
    backend = cache_manifest.entry(cache.directory, cache.manifest, "backend.name")
    mismatch = backend != checkpoint["trained_with"]
    if mismatch and not settings.get("allow_backend_mismatch"):
        raise DflashEvalError(
            f"{cache.directory}: hidden states were extracted with the {backend!r} kernels but drafter "
            f"{settings['drafter']} was trained with {checkpoint['trained_with']!r} ones; they differ measurably. "
            "Extract with the training backend (target.backend), or set evaluation.allow_backend_mismatch: true "
            "to evaluate anyway (the report will say so)."
        )
    return {
        "dir": str(cache.directory),
        "backend": backend,
        "trained_with": checkpoint["trained_with"],
        "backend_mismatch_allowed": mismatch,
        "target_config_hash": cached_hash,
    }


def run_evaluation(
    settings: dict, hidden: str, completions: str, placement: str | None = None, device: torch.device | None = None
) -> tuple[dict, list[dict]]:
    """One checkpoint on one cache. `device`: one this process claimed already (`run_several`), else claimed here."""
    from dflash_eval.cache.store import HiddenCache

    if device is None:
        device = claim_settings_device(settings, placement, f"evaluate {settings['drafter']} {settings['dataset']}")
    dtype = DTYPES[settings["dtype"]]
    cache = HiddenCache(hidden, verify=True)  # every shard read is checked against its sha256 (cache.verify)
    cache_info = check_cache(cache, settings)
    records = {record["id"]: record for record in read_completions(completions)}
    completions_check.check(cache.directory, cache.manifest, completions, records)  # the file it was built from
    head = load_target_head(settings["target"]["path"])
    checkpoint = settings["checkpoint"]
    sha256_at_load = checkpoint_sha256(checkpoint["path"])  # before the load; compared again after the evaluation
    loaded = load_drafter(
        checkpoint["path"],
        checkpoint["layout"],
        checkpoint.get("config"),
        checkpoint["layer_ids"],
        checkpoint["allow_pickle"],
        vocab_size=head.embed.shape[0],
    )
    check_against_target(loaded.path, loaded.config.hidden_size, None, head.embed.shape[1], None)
    drafter_kind.check_sampled(
        settings["drafter"], loaded.model, settings["dataset"], _sampling_of(records, completions)
    )
    runner = BlockDrafter(loaded.model, head.embed, head.lm_head, loaded.mask_token_id).to(device=device, dtype=dtype)
    stops = stop_token_ids(settings)
    block = loaded.block_size
    block_sizes = requested_block_sizes(settings.get("block_sizes"), block)
    budgets = sorted(set(settings.get("ddtree_budgets") or []))
    topk = sorted(set(settings.get("topk") or []))
    per_method: dict[str, dict[str, list[int]]] = {}
    rows, skipped = [], []
    agreement = {"agree": 0, "seen": 0}
    topk_hits = np.zeros((block - 1, len(topk)), dtype=np.int64)
    topk_seen = np.zeros(block - 1, dtype=np.int64)

    def loader(sample_id: str, record: dict):
        def load() -> LoadedSample:
            states = cache.load_sample(sample_id, loaded.layer_ids)
            tokens = states.input_ids.to(device)
            max_tokens = record.get("request", {}).get("max_tokens", settings.get("max_tokens"))
            limits = acceptance.sequence_limits(states.prompt_len, len(tokens), max_tokens, int(tokens[-1]) in stops)
            if states.argmax is not None and len(tokens) > states.prompt_len:
                predicted = states.argmax[states.prompt_len - 1 : -1]
                agreement["agree"] += int((predicted == states.input_ids[states.prompt_len :]).sum())
                agreement["seen"] += len(predicted)
            return LoadedSample(states.features.to(device=device, dtype=dtype), tokens, limits)

        return load

    specs, order = [], []
    # By sample id, not the cache's (the prompt file's) order: the evaluator's batches, samples.csv and the bootstrap,
    # which resamples by position, are then the same for a reordered prompt file
    for entry in sorted(cache.samples, key=lambda e: str(e["id"])):
        sample_id = str(entry["id"])
        record = records.get(sample_id)
        if record is None:
            skipped.append({"id": sample_id, "why": "not in the completions file"})
            continue
        specs.append(SampleSpec(sample_id, int(entry["length"]), loader(sample_id, record)))
        order.append((sample_id, entry))
    evaluator = TrajectoryEvaluator(
        runner,
        set(stops),
        block_sizes,
        budgets,
        topk,
        EvaluatorOptions(
            blocks_per_forward=settings["blocks_per_forward"],
            **graph_options(settings.get("cuda_graphs") or "none", device, runner),
        ),
    )
    results = dict(
        tqdm(
            evaluator.run(specs),
            total=len(specs),
            unit="sample",
            desc=f"evaluate {settings['drafter']} on {settings['dataset']}",
        )
    )
    agree, seen = agreement["agree"], agreement["seen"]
    for sample_id, entry in order:  # by id (above)
        result = results[sample_id]
        topk_hits += result.topk_hits
        topk_seen += result.topk_seen
        for method, steps in result.steps.items():
            per_method.setdefault(method, {})[sample_id] = steps
            rows.append(
                {
                    "id": sample_id,
                    "method": method,
                    "prompt_tokens": entry["prompt_len"],
                    "completion_tokens": entry["length"] - entry["prompt_len"],
                    "steps": len(steps),
                    "tokens": sum(steps),
                    "tau": sum(steps) / len(steps) if steps else float("nan"),
                    "acceptance_lengths": " ".join(map(str, steps)),
                }
            )
    cache_info["shards_verified"] = cache.verified()  # raises for a damaged shard: no metrics from it
    clusters = {
        sample_id: prompt_cluster(sample_id, records[sample_id].get("sampling") is not None)
        for sample_id, _entry in order
    }  # the n draws of a prompt are resampled together
    methods = {
        method: method_metrics(method, list(by_sample.values()), block, settings, [clusters[i] for i in by_sample])
        for method, by_sample in per_method.items()
    }
    primary = chain_method(block)
    speedup = drafter_section(
        methods,
        lambda blocks, trees: time_drafter_on_cache(
            runner, cache, loaded.layer_ids, device, dtype, settings.get("speedup") or {}, blocks, None, trees
        ),
    )
    rejection, sampling = None, _sampling_of(records, completions)
    # greedy completions: dflash_generate's scheme at T = 0 is target_only's greedy verification (docs/sampling.md)
    if REJECTION in verify_schemes(settings.get("verify")) and sampling is not None:
        rejection = _rejection(
            runner,
            cache,
            records,
            order,
            completions,
            loaded.layer_ids,
            device,
            dtype,
            stops,
            settings,
            block_sizes,
            clusters,
        )
        cache_info["shards_verified"] = cache.verified()
    _check_unchanged(loaded.path, sha256_at_load)
    metrics = {
        STAMP: stage_stamp("evaluate"),  # the code that made these numbers (`dflash-eval status` reads it)
        "drafter": settings["drafter"],
        "dataset": settings["dataset"],
        "checkpoint": {
            "path": loaded.path,
            "layout": loaded.layout,
            "sha256": sha256_at_load,
            "global_step": loaded.global_step,
            "epoch": loaded.epoch,
            "step": checkpoint.get("step"),
        },
        "block_size": block,
        "layer_ids": loaded.layer_ids,
        "attention_layout": attention_layout.metrics_section(loaded.attention_layout),
        "cache": cache_info,
        "stop_token_ids": stops,
        "device": str(device),
        "dtype": settings["dtype"],
        "chain": methods.get(primary) or method_metrics(primary, [], block, settings),
        "methods": methods,
        "topk_accuracy": {
            "k": topk,
            "counted_on": f"the blocks {primary}'s trajectory drafts",
            "positions_seen": topk_seen.tolist(),
            "by_position": [
                [float(h) / s if s else None for h in hits] for hits, s in zip(topk_hits.tolist(), topk_seen.tolist())
            ],
        },
        "diagnostics": {
            "argmax_agreement": agree / seen if seen else None,
            "tokens_seen": seen,
            "samples_skipped": skipped,
            "drafter_blocks": evaluator.counts.blocks,
            "sampled_check": sampled_check.check(agree / seen if seen else None, seen, sampling, rejection),
            "all_anchor_blocks": evaluator.counts.all_anchor_blocks,
        },
        "speedup": speedup,
        "verify": verify_schemes(settings.get("verify")),
        "sampling": sampling,
    }
    if rejection is not None:
        metrics[REJECTION] = rejection
    return metrics, rows


def _sampling_of(records: dict, completions: str) -> list[dict] | None:
    """The dataset's distinct sampling parameters (SGLang's spelling); None for greedy completions."""
    from dflash_eval.cache.sampling import from_record

    found = {tuple(sorted(p.as_dict().items())) for r in records.values() if (p := from_record(r, completions))}
    return [dict(t) for t in sorted(found)] or None


def _rejection(
    runner, cache, records, order, completions, layer_ids, device, dtype, stops, settings, block_sizes, clusters
) -> dict:
    """The rejection scheme's section (evaluate.rejection_metrics), over the samples the trajectories used: one
    chain per evaluated block size (DDTree has no rejection-sampled reference: preflight refuses it alone)."""
    stored = rejection_metrics.check_cache(cache, settings["drafter"], runner)
    dists, params, outside, read = {}, {}, {}, {}
    for sample_id, _entry in order:
        record = records[sample_id]
        params[sample_id] = rejection_metrics.sample_params(stored, record, completions)

        def load(sample_id=sample_id, record=record):
            states = cache.load_sample(sample_id, layer_ids)
            tokens = states.input_ids.to(device)
            max_tokens = record.get("request", {}).get("max_tokens", settings.get("max_tokens"))
            limits = acceptance.sequence_limits(states.prompt_len, len(tokens), max_tokens, int(tokens[-1]) in stops)
            return states.features.to(device=device, dtype=dtype), tokens, states.logprob.to(device), limits

        dists[sample_id], outside[sample_id], read[sample_id] = rejection_metrics.sample_distribution(
            runner, load, params[sample_id], set(stops), settings["blocks_per_forward"], block_sizes
        )
    return rejection_metrics.section(
        dists, params, block_sizes, settings, clusters, rejection_metrics.outside_support(outside, read)
    )


def requested_block_sizes(requested: list[int] | str | None, block: int) -> list[int]:
    """Chain block sizes to evaluate: the drafter's own B plus those asked for that fit (2..B)."""
    if requested == "all":
        return list(range(2, block + 1))
    sizes = sorted({int(b) for b in requested or []} | {block})
    too_big = [b for b in sizes if b > block]
    if too_big:
        log.warning("block sizes %s exceed the drafter's block size %d; skipped", too_big, block)
    return [b for b in sizes if b <= block]


def method_metrics(
    method: str, per_sample: list[list[int]], block: int, settings: dict, clusters: list[str] | None = None
) -> dict:
    """tau (both conventions), bootstrap CI (over `clusters`, one per sample, when given), counts, acceptance by
    position and histogram of one method."""
    parsed = parse_method(method)
    depth = parsed.block_size(block)
    return {
        "method": method,
        "kind": parsed.kind.name,
        "scheme": TARGET_ONLY,
        "block_size": depth,
        "budget": parsed.budget,
        **stats.tau_stats(per_sample),
        "ci95": stats.bootstrap_ci(per_sample, settings["bootstrap"], settings["seed"], clusters=clusters),
        "acceptance_by_position": stats.acceptance_by_position(per_sample, depth),
        "histogram": stats.histogram(per_sample, depth),
    }


SAMPLES_COLUMNS = ("id", "method", "prompt_tokens", "completion_tokens", "steps", "tokens", "tau", "acceptance_lengths")


def samples_csv(rows: list[dict]) -> str:
    """samples.csv as pandas' to_csv wrote it (NaN as an empty field), without importing pandas (its import is a large share of a job's start-up)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SAMPLES_COLUMNS)
    for row in rows:
        writer.writerow(["" if isinstance(v, float) and math.isnan(v) else v for v in map(row.get, SAMPLES_COLUMNS)])
    return out.getvalue()


def _check_unchanged(path: str, sha256_at_load: str) -> None:
    """The checkpoint's sha256 now against the one taken before it was loaded: a checkpoint replaced while it was
    evaluated (a training run writing its next save to the same path) would put the new file's hash beside the
    old weights' tau. Nothing is written then; the next run evaluates the new file."""
    now = checkpoint_sha256(path)
    if now != sha256_at_load:
        raise DflashEvalError(
            f"{path}: the checkpoint changed while it was evaluated (sha256 {sha256_at_load[:12]} "
            f"before the load, {now[:12]} after the evaluation); no metrics are written: rerun "
            "once the file is no longer being written"
        )


def claim_settings_device(settings: dict, placement: str | None, job: str) -> torch.device:
    """The evaluation's device: cuda = a GPU no other evaluation holds, held until this process exits;
    `placement` records which, for `dflash-eval gpu-placements`."""
    from dflash_eval.target_identity import parse_device

    parse_device(settings["device"], "evaluation.device")  # named errors: a CPU-only torch, no such GPU
    return claim_device(settings["device"], record=placement, job=job)


def write_outputs(metrics: dict, rows: list[dict], metrics_path: str, samples_path: str) -> None:
    for method, numbers in metrics["methods"].items():
        log.info(
            "%s on %s, %s: tau %.3f (z-lab mean), %.3f (token-weighted), %d samples, %d steps",
            metrics["drafter"],
            metrics["dataset"],
            method,
            numbers["tau_mean_of_samples"],
            numbers["tau_token_weighted"],
            numbers["samples"],
            numbers["steps"],
        )
    atomic_write_text(samples_path, samples_csv(rows))
    atomic_write_json(metrics_path, metrics)
