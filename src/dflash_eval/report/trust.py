"""The report's "can I trust this" panel: what the measurement rests on, gathered from every stage's files.

Each input is read when present and reported as "not recorded" when absent, so the report never
fails because an upstream stage did not (yet) write something: caches (manifest.json of each hidden
directory), fetch records (completions JSONL: token checks, id sources, the server's own speculative
stats), and the server hook's transitions log (outages around extraction). Only JSON is read here
(no torch): the report stays fast.

Online vs offline is report/online.py: the server's own counters per request beside the served
drafter's offline steps at the served block size, the conventions lined up.

Data only, as dicts (trust.json holds them); report/trust_section.py renders them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_eval import completions
from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import sha256_file
from dflash_eval.report import online as online_check
from dflash_eval.report import served_drafter
from dflash_eval.report.metrics_files import Evaluation, per_sample_steps

log = logging.getLogger(__name__)

NOT_RECORDED = "not recorded"


# -- caches ---------------------------------------------------------------------------------------


def cache_entry(directory: str | Path, completions_sha256: str | None) -> dict:
    """One cache's provenance from its manifest; `completions_match` compares the file it was built from."""
    directory = Path(directory)
    manifest = cache_manifest.read(directory)
    if manifest is None:
        return {"dir": str(directory), "recorded": False}
    target, backend = manifest.get("target") or {}, manifest.get("backend") or {}
    agreement = manifest.get("argmax_agreement") or {}
    built_from = (manifest.get("completions") or {}).get("sha256")
    flags = manifest.get("token_flags")
    return {
        "dir": str(directory),
        "recorded": True,
        "dataset": manifest.get("dataset"),
        "target": target.get("path"),
        "model_type": target.get("model_type"),
        "target_config_hash": target.get("config_hash"),
        "num_hidden_layers": target.get("num_hidden_layers"),
        "layer_ids": manifest.get("layer_ids"),
        "dtype": target.get("dtype"),
        "device": manifest.get("device"),
        "device_name": backend.get("device_name"),
        "backend": backend.get("name"),
        "implementation": backend.get("implementation"),
        "versions": backend.get("versions"),
        "shards": [
            {"file": s.get("file"), "sha256": s.get("sha256"), "tokens": s.get("tokens"), "bytes": s.get("bytes")}
            for s in manifest.get("shards") or []
        ],
        "samples": len(manifest.get("samples") or []),
        "argmax_agreement": agreement["matches"] / agreement["tokens"] if agreement.get("tokens") else None,
        "token_flags": None if flags is None else {k: list(v) for k, v in flags.items()},
        "positions": manifest.get("positions"),  # {max_position_embeddings, past: ids}; None: not recorded
        "completions_sha256": built_from,
        "completions_match": None
        if built_from is None or completions_sha256 is None
        else built_from == completions_sha256,
    }


# -- fetch records --------------------------------------------------------------------------------


@dataclass
class FetchRecords:
    """What the report needs of one completions file: token checks, id sources, online stats."""

    path: Path
    sha256: str
    prompt_mismatch: list[str] = field(default_factory=list)
    completion_mismatch: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    records: int = 0
    spec: dict[str, dict] = field(default_factory=dict)  # id -> online.request_counters(record)
    served: list[dict] = field(default_factory=list)  # the distinct online.served_settings
    sampling: list[dict] = field(default_factory=list)  # the distinct sampling parameters (seed aside)
    sampling_warnings: list[str] = field(default_factory=list)  # the distinct fetch.sglang.sampling_warning texts


def scan_completions(path: str | Path) -> FetchRecords:
    """Scan one completions JSONL through dflash_eval.completions (bad lines are errors naming the line)."""
    path = Path(path)
    out = FetchRecords(path=path, sha256=sha256_file(path))
    for _, record in completions.iter_records(path):
        sample_id = record["id"]
        out.records += 1
        check = record.get("token_check")
        if check is None:
            out.unchecked.append(sample_id)
        else:
            if check.get("prompt_tokens_match") is False:
                out.prompt_mismatch.append(sample_id)
            if check.get("completion_tokens_match") is False:
                out.completion_mismatch.append(sample_id)
        source = str(record.get("completion_ids_source") or NOT_RECORDED)
        out.sources[source] = out.sources.get(source, 0) + 1
        counters = online_check.request_counters(record)
        if counters is not None:
            out.spec[sample_id] = counters
        served = online_check.served_settings(record)
        if served is not None and served not in out.served:
            out.served.append(served)
        drawn = {k: v for k, v in (record.get("sampling") or {}).items() if k != "seed"}
        if drawn and drawn not in out.sampling:
            out.sampling.append(drawn)
        warning = record.get("sampling_warning")
        if warning and warning not in out.sampling_warnings:
            out.sampling_warnings.append(warning)
    return out


def fetch_entry(records: FetchRecords | None) -> dict:
    """Per dataset: token mismatches between our ids and the server's counts, and where ids came from."""
    if records is None:
        return {"recorded": False}
    return {
        "recorded": True,
        "path": str(records.path),
        "sha256": records.sha256,
        "records": records.records,
        "prompt_token_mismatches": records.prompt_mismatch,
        "completion_token_mismatches": records.completion_mismatch,
        "token_check_absent": records.unchecked,
        "completion_ids_source": dict(sorted(records.sources.items())),
        "with_spec_stats": len(records.spec),
        **({"sampling": records.sampling} if records.sampling else {}),  # a greedy file: no key (as before)
        **({"sampling_warnings": records.sampling_warnings} if records.sampling_warnings else {}),
    }


# -- online vs offline ----------------------------------------------------------------------------


def online_vs_offline(
    records: FetchRecords | None,
    offline_steps: dict[str, dict[str, list[int]]] | None,
    tolerance: float,
    own_block: int | None = None,
) -> dict:
    """The server's own counters beside the offline steps on the same samples (report.online.compare)."""
    return online_check.compare(
        records.spec if records is not None else {},
        offline_steps,
        own_block,
        tolerance,
        sampled=bool(records is not None and records.sampling),
    )


# -- server outages -------------------------------------------------------------------------------


def server_outages(path: str | Path | None) -> dict:
    """Outages from transitions.jsonl: each `pause` with the server up, until its `resume`.

    Extraction jobs that overlap share one outage (later ones log `joined`), so an outage counts the
    extractions it served, and apart from them the profile-server runs (`profile_start`) it served. A pause
    without a resume is an outage that never ended (the server may still be down). Stopping a launched server
    at the end of a run is not an outage: nobody waits for it.
    """
    if path is None or not Path(path).is_file():
        return {"recorded": False, "path": None if path is None else str(path)}
    outages: list[dict] = []
    open_pause: dict | None = None
    extractions = profiles = 0
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                name, _unix = event["event"], float(event["unix"])  # checked here: _outage measures from it
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise DflashEvalError(f"{path}:{number}: not a server transition ({error!r})") from error
            if name == "pause" and event.get("was_up"):
                if open_pause is not None:
                    outages.append(_outage(open_pause, None, extractions, profiles))
                open_pause, extractions, profiles = event, 0, 0
            elif name == "extraction_start" and open_pause is not None:
                extractions += 1
            elif name == "profile_start" and open_pause is not None:
                profiles += 1
            elif name == "resume" and open_pause is not None:
                outages.append(_outage(open_pause, event, extractions, profiles))
                open_pause = None
    if open_pause is not None:
        outages.append(_outage(open_pause, None, extractions, profiles))
    ended = [o["seconds"] for o in outages if o["seconds"] is not None]
    return {
        "recorded": True,
        "path": str(path),
        "outages": outages,
        "count": len(outages),
        "total_s": sum(ended),
        "longest_s": max(ended) if ended else None,
        "unrestored": sum(o["seconds"] is None or not o["restored"] for o in outages),
    }


def _outage(pause: dict, resume: dict | None, extractions: int, profiles: int = 0) -> dict:
    restored = bool(resume and resume.get("restored"))
    seconds = None if resume is None else round(float(resume["unix"]) - float(pause["unix"]), 3)
    return {
        "start": pause.get("time"),
        "end": None if resume is None else resume.get("time"),
        "seconds": seconds,
        "restored": restored,
        "by_pid": pause.get("by_pid"),
        "extractions": extractions,
        "profiles": profiles,
    }


# -- the panel ------------------------------------------------------------------------------------


def panel(
    evaluations: list[Evaluation],
    settings: dict,
    hidden: Iterable[str | Path],
    completions: Iterable[str | Path],
    transitions: str | Path | None,
) -> dict:
    """Everything the "can I trust this" panel shows (trust.json holds it, with the warnings added)."""
    fetched = {}
    for path in map(Path, completions):
        if path.is_file():
            fetched[path.name.removesuffix(".jsonl")] = scan_completions(path)
        else:
            log.warning("%s not found: its fetch checks are reported as not recorded", path)
    cache_dataset = {os.path.abspath(e.metrics["cache"]["dir"]): e.key[1] for e in evaluations}
    directories: dict[str, str] = {}  # absolute path -> as first named (relative paths stay relative)
    for directory in [str(h) for h in hidden] + [str(e.metrics["cache"]["dir"]) for e in evaluations]:
        directories.setdefault(os.path.abspath(directory), os.path.normpath(directory))
    caches = []
    for key, directory in directories.items():
        dataset = cache_dataset.get(key, Path(directory).parent.name)
        caches.append(cache_entry(directory, fetched[dataset].sha256 if dataset in fetched else None))
    served = settings.get("served_drafter")
    by_key = {e.key: e for e in evaluations}
    online = {}
    for dataset in settings["datasets"]:
        steps, own_block, check = None, None, None
        if served is not None:
            evaluation = by_key[(served, dataset)]
            steps, own_block = per_sample_steps(evaluation), evaluation.metrics["block_size"]
            records = fetched.get(dataset)
            check = served_drafter.check_served_drafter(
                records.served if records else [],
                evaluation.metrics["checkpoint"],
                own_block,
                bool(settings["allow_served_drafter_mismatch"]),
            )
        entry = online_vs_offline(
            fetched.get(dataset),
            None if check and check["refused"] else steps,
            float(settings["online_tolerance"]),
            own_block,
        )
        if check and check["refused"] and entry.get("recorded"):
            entry = {
                **entry,
                "compared": False,
                "why": "the server does not serve report.served_drafter: "
                f"{'; '.join(check['problems'])} (report.allow_served_drafter_mismatch: true pairs them anyway)",
            }
        online[dataset] = {**entry, "drafter": served, "served_drafter_check": check}
    return {
        "caches": caches,
        "fetch": {dataset: fetch_entry(fetched.get(dataset)) for dataset in settings["datasets"]},
        "evaluations": [evaluation_entry(e) for e in evaluations],
        "online": online,
        "server": server_outages(transitions),
    }


def evaluation_entry(evaluation: Evaluation) -> dict:
    """What one evaluation says about itself: backend, argmax agreement with the completions, skips."""
    metrics = evaluation.metrics
    cache, diagnostics = metrics["cache"], metrics["diagnostics"]
    return {
        "drafter": metrics["drafter"],
        "dataset": metrics["dataset"],
        "cache_dir": cache["dir"],
        "backend": cache["backend"],
        "trained_with": cache.get("trained_with"),
        "backend_mismatch_allowed": bool(cache["backend_mismatch_allowed"]),
        "argmax_agreement": diagnostics.get("argmax_agreement"),
        "tokens_seen": diagnostics.get("tokens_seen"),
        "samples": int(metrics["chain"]["samples"]),
        "samples_skipped": list(diagnostics.get("samples_skipped") or []),
    }
