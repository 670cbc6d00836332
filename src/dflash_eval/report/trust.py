"""The report's "can I trust this" panel: what the measurement rests on, gathered from every stage's files.

Each input is read when present and reported as "not recorded" when absent, so the report never
fails because an upstream stage did not (yet) write something: caches (manifest.json of each hidden
directory), fetch records (completions JSONL: token checks, id sources, the server's own speculative
stats), and the server hook's transitions log (outages around extraction). Only JSON is read here
(no torch): the report stays fast.

Online tau is SGLang's `spec_accept_length` (completion tokens / verification steps, bonus token
included) per request, compared with the served drafter's own-block chain tau on the same samples.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import sha256_file
from dflash_eval.report import online as online_check

log = logging.getLogger(__name__)

NOT_RECORDED = "not recorded"
MANIFEST = "manifest.json"


# -- caches ---------------------------------------------------------------------------------------

def read_json(path: Path) -> dict | None:
    """A JSON file, None when absent; a corrupt one is an error that names it."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DflashEvalError(f"{path}: not valid JSON ({error}); re-run the stage that writes it") from error


def cache_entry(directory: str | Path, completions_sha256: str | None) -> dict:
    """One cache's provenance from its manifest; `completions_match` compares the file it was built from."""
    directory = Path(directory)
    manifest = read_json(directory / MANIFEST)
    if manifest is None:
        return {"dir": str(directory), "recorded": False}
    target, backend = manifest.get("target") or {}, manifest.get("backend") or {}
    agreement = manifest.get("argmax_agreement") or {}
    built_from = (manifest.get("completions") or {}).get("sha256")
    flags = manifest.get("token_flags")
    return {
        "dir": str(directory), "recorded": True, "dataset": manifest.get("dataset"),
        "target": target.get("path"), "model_type": target.get("model_type"),
        "target_config_hash": target.get("config_hash"), "num_hidden_layers": target.get("num_hidden_layers"),
        "layer_ids": manifest.get("layer_ids"), "dtype": target.get("dtype"), "device": manifest.get("device"),
        "device_name": backend.get("device_name"), "backend": backend.get("name"),
        "implementation": backend.get("implementation"), "versions": backend.get("versions"),
        "shards": [{"file": s.get("file"), "sha256": s.get("sha256"), "tokens": s.get("tokens"),
                    "bytes": s.get("bytes")} for s in manifest.get("shards") or []],
        "samples": len(manifest.get("samples") or []),
        "argmax_agreement": agreement["matches"] / agreement["tokens"] if agreement.get("tokens") else None,
        "token_flags": None if flags is None else {k: list(v) for k, v in flags.items()},
        "completions_sha256": built_from,
        "completions_match": None if built_from is None or completions_sha256 is None
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
    spec: dict[str, dict] = field(default_factory=dict)        # id -> online.request_counters(record)


def read_completions(path: str | Path) -> FetchRecords:
    """Scan one completions JSONL (contract in docs/contracts.md); bad lines are errors naming the line."""
    path = Path(path)
    out = FetchRecords(path=path, sha256=sha256_file(path))
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                sample_id = str(record["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise DflashEvalError(f"{path}:{number}: not a completion record ({error!r}); re-run fetch") from error
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
    return out


def fetch_entry(records: FetchRecords | None) -> dict:
    """Per dataset: token mismatches between our ids and the server's counts, and where ids came from."""
    if records is None:
        return {"recorded": False}
    return {"recorded": True, "path": str(records.path), "sha256": records.sha256, "records": records.records,
            "prompt_token_mismatches": records.prompt_mismatch,
            "completion_token_mismatches": records.completion_mismatch,
            "token_check_absent": records.unchecked, "completion_ids_source": dict(sorted(records.sources.items())),
            "with_spec_stats": len(records.spec)}


# -- online vs offline ----------------------------------------------------------------------------

def online_vs_offline(records: FetchRecords | None, offline_steps: dict[str, dict[str, list[int]]] | None,
                      tolerance: float, own_block: int | None = None) -> dict:
    """The server's own counters beside the offline steps on the same samples (report.online.compare)."""
    return online_check.compare(records.spec if records is not None else {}, offline_steps, own_block, tolerance)


# -- server outages -------------------------------------------------------------------------------

def server_outages(path: str | Path | None) -> dict:
    """Outages from transitions.jsonl: each `pause` with the server up, until its `resume`.

    Extraction jobs that overlap share one outage (later ones log `joined`), so an outage counts the
    extractions it served. A pause without a resume is an outage that never ended (the server may
    still be down). Stopping a launched server at the end of a run is not an outage: nobody waits for it.
    """
    if path is None or not Path(path).is_file():
        return {"recorded": False, "path": None if path is None else str(path)}
    outages: list[dict] = []
    open_pause: dict | None = None
    extractions = 0
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                name, when = event["event"], float(event["unix"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise DflashEvalError(f"{path}:{number}: not a server transition ({error!r})") from error
            if name == "pause" and event.get("was_up"):
                if open_pause is not None:
                    outages.append(_outage(open_pause, None, extractions))
                open_pause, extractions = event, 0
            elif name == "extraction_start" and open_pause is not None:
                extractions += 1
            elif name == "resume" and open_pause is not None:
                outages.append(_outage(open_pause, event, extractions))
                open_pause = None
    if open_pause is not None:
        outages.append(_outage(open_pause, None, extractions))
    ended = [o["seconds"] for o in outages if o["seconds"] is not None]
    return {"recorded": True, "path": str(path), "outages": outages, "count": len(outages),
            "total_s": sum(ended), "longest_s": max(ended) if ended else None,
            "unrestored": sum(o["seconds"] is None or not o["restored"] for o in outages)}


def _outage(pause: dict, resume: dict | None, extractions: int) -> dict:
    restored = bool(resume and resume.get("restored"))
    seconds = None if resume is None else round(float(resume["unix"]) - float(pause["unix"]), 3)
    return {"start": pause.get("time"), "end": None if resume is None else resume.get("time"),
            "seconds": seconds, "restored": restored, "by_pid": pause.get("by_pid"), "extractions": extractions}


# -- warnings and markdown ------------------------------------------------------------------------

def warnings(trust: dict) -> list[str]:
    """The trust findings that make a number suspect, one markdown line each."""
    found = []
    for dataset, fetch in trust["fetch"].items():
        bad = sorted(set(fetch.get("prompt_token_mismatches", [])) | set(fetch.get("completion_token_mismatches", [])))
        if bad:
            found.append(f"**Token mismatch at fetch**: {dataset}: {len(bad)} of {fetch['records']} records' token "
                         f"ids disagree with the server's own counts (e.g. {', '.join(bad[:3])}); their tau "
                         "is measured on tokens the server may not have produced.")
    for cache in trust["caches"]:
        if cache.get("completions_match") is False:
            found.append(f"**Stale cache**: {cache['dir']} was extracted from another completions file "
                         f"(sha256 {str(cache['completions_sha256'])[:12]}) than the one fetched now; re-run extraction.")
    for dataset, online in trust["online"].items():
        if online.get("beyond_tolerance"):
            found.append(f"**Online ≠ offline**: {dataset}: the server measured tau "
                         f"{online['online_tau_compared']:.2f}, offline gives {online['offline_tau_compared']:.2f} for "
                         f"{online['drafter']} on the same {online['samples_compared']} samples "
                         f"({online['relative_difference']:.1%} apart, tolerance {online['tolerance']:.1%}).")
    server = trust["server"]
    if server.get("recorded") and server["unrestored"]:
        found.append(f"**Server not restored**: {server['unrestored']} pause(s) in {server['path']} have no "
                     "successful resume; check that the server is up.")
    return found


def _short(digest: Any, digits: int = 12) -> str:
    return str(digest)[:digits] if digest else NOT_RECORDED


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _versions(versions: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) if versions else NOT_RECORDED


def cache_table(caches: list[dict]) -> list[str]:
    """One row per cache: what produced the hidden states the drafters were scored on."""
    header = ["cache", "target", "layers", "kernel backend", "versions", "dtype", "device", "shards (sha256)",
              "built from completions"]
    lines = [_row(header), _row(["---"] * len(header))]
    for cache in caches:
        if not cache["recorded"]:
            lines.append(_row([f"`{cache['dir']}`"] + [NOT_RECORDED] * (len(header) - 1)))
            continue
        target = f"{cache['target']} ({cache['model_type']}, {cache['num_hidden_layers']} layers, config " \
                 f"{_short(cache['target_config_hash'])})"
        device = cache["device"] or NOT_RECORDED
        if cache.get("device_name") and cache["device_name"] != device:
            device += f" ({cache['device_name']})"
        shards = "<br>".join(f"{s['file']} {_short(s['sha256'])}" for s in cache["shards"]) or NOT_RECORDED
        built = {None: f"{_short(cache['completions_sha256'])} (current file {NOT_RECORDED})",
                 True: f"{_short(cache['completions_sha256'])} (= current file)",
                 False: f"**{_short(cache['completions_sha256'])} ⚠️ NOT the current file**"}[cache["completions_match"]]
        lines.append(_row([f"`{cache['dir']}`", target, ", ".join(map(str, cache["layer_ids"] or [])) or NOT_RECORDED,
                           f"{cache['backend'] or NOT_RECORDED}", _versions(cache["versions"]),
                           cache["dtype"] or NOT_RECORDED, device, shards, built]))
    return lines


def fetch_cells(fetch: dict) -> list[str]:
    """Token mismatches and id sources of one dataset's fetch, for the per-evaluation table."""
    if not fetch.get("recorded"):
        return [NOT_RECORDED, NOT_RECORDED]
    prompt, completion = len(fetch["prompt_token_mismatches"]), len(fetch["completion_token_mismatches"])
    text = f"prompt {prompt}, completion {completion} of {fetch['records']}"
    if prompt or completion:
        text = f"**{text} ⚠️**"
    if fetch["token_check_absent"]:
        text += f"; {len(fetch['token_check_absent'])} unchecked"
    sources = ", ".join(f"{name} {count}" for name, count in fetch["completion_ids_source"].items())
    return [text, sources]


def online_table(online: dict[str, dict]) -> list[str]:
    """Per dataset: the server's own speculative tau beside the offline tau of the drafter it served."""
    return online_check.table(online)


def outage_lines(server: dict) -> list[str]:
    """Each pause of the server around extraction and how long it lasted."""
    if not server.get("recorded"):
        where = f" ({server['path']} absent)" if server.get("path") else ""
        return [f"Server transitions: {NOT_RECORDED}{where}."]
    if not server["outages"]:
        return [f"No server outage in `{server['path']}` (the server was never paused while up)."]
    longest = "n/a" if server["longest_s"] is None else f"{server['longest_s']:.1f} s"
    lines = [f"{server['count']} outage(s) in `{server['path']}`, {server['total_s']:.1f} s in all, longest {longest}.",
             "", _row(["paused at", "back at", "outage", "restored", "extractions"]),
             _row(["---", "---", "---:", "---", "---:"])]
    for outage in server["outages"]:
        seconds = "**never ended ⚠️**" if outage["seconds"] is None else f"{outage['seconds']:.1f} s"
        lines.append(_row([outage["start"], outage["end"] or "–", seconds,
                           "yes" if outage["restored"] else "**no ⚠️**", outage.get("extractions", 0)]))
    return lines
