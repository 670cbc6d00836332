"""Resuming a hidden cache: which shards are already done, checked byte for byte.

Extraction of a large dataset takes hours of GPU time, so a killed run must not cost the shards it
finished. The assignment of samples to shards is a pure function of the sample lengths and
`shard_tokens` (`plan_shards`), so a rerun knows which samples each shard must hold. The writer
works in `<out>.partial/` and appends one journal line per shard once its file is written; a rerun
with the same inputs (`plan_key`) keeps every journaled shard whose size and sha256 still match and
whose samples are the planned ones, and redoes the rest. A published cache
whose shards no longer match its manifest is resumed the same way. Snakemake deletes a rule's
declared outputs before rerunning it; `<out>.partial/` is not one, so it survives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.manifest import MANIFEST, CacheError
from dflash_eval.io_utils import sha256_file

log = logging.getLogger(__name__)

JOURNAL = "journal.jsonl"
PLAN = "plan.json"


def partial_dir(out: Path) -> Path:
    """The writer's working directory for `out`."""
    return out.with_name(f"{out.name}.partial")


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Sample indices per shard, in order: fill up to `shard_tokens`, a longer sample alone, a halving tail.

    The last shard is written after the last forward, with nothing left to overlap it, so the final
    `shard_tokens` worth of samples is cut into shards of halving size (see `_halving_tail`): the
    wait at the end shrinks from a whole shard's write to about one sample's. The cache writer packs
    the head by exactly this greedy rule and closes a shard wherever the plan says (tests hold the two
    together).
    """
    start = len(lengths)
    tail_tokens = 0
    while start > 0 and tail_tokens + lengths[start - 1] <= shard_tokens:
        start -= 1
        tail_tokens += lengths[start]
    return greedy_shards(lengths[:start], shard_tokens) + _halving_tail(lengths, start)


def greedy_shards(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Fill each shard up to `shard_tokens`; a sample longer than that gets a shard of its own."""
    shards: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, length in enumerate(lengths):
        if length > shard_tokens:
            if current:
                shards.append(current)
            shards.append([index])
            current, filled = [], 0
            continue
        if filled + length > shard_tokens:
            shards.append(current)
            current, filled = [], 0
        current.append(index)
        filled += length
        if filled == shard_tokens:
            shards.append(current)
            current, filled = [], 0
    if current:
        shards.append(current)
    return shards


def _halving_tail(lengths: Sequence[int], start: int) -> list[list[int]]:
    """Samples start.. in shards that each hold at most half of what is left (at least one sample).

    Shard k's write then overlaps the forwards of the shards after it, which hold about as many
    tokens; the writer (hash and file write) is several times faster than the forward.
    """
    shards: list[list[int]] = []
    rest = list(range(start, len(lengths)))
    while rest:
        half = sum(lengths[i] for i in rest) / 2
        take, filled = 1, lengths[rest[0]]
        while take < len(rest) and filled + lengths[rest[take]] <= half:
            filled += lengths[rest[take]]
            take += 1
        shards.append(rest[:take])
        rest = rest[take:]
    return shards


def plan_key(fields: dict[str, Any]) -> str:
    """Hash of everything that decides a cache's bytes (inputs, target, layers, backend, versions)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Journal entries; a torn last line (killed mid-append) is dropped with a warning."""
    if not path.is_file():
        return []
    entries = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: torn journal line dropped (the run was killed while writing it)", path, number)
    return entries


_JOURNAL_LOCK = threading.Lock()  # the cache writer's threads finish shards concurrently


def append_journal(path: Path, entry: dict[str, Any]) -> None:
    """One line per finished shard; a kill can lose at most the line being written.

    Neither this line nor the shard's bytes are fsynced: a killed process loses nothing the
    kernel already holds, and after a power loss a line whose shard did not reach the disk is
    harmless, because a resuming run keeps a journaled shard only if its size and sha256 still
    match (`_shard_intact`). Syncing each shard slows the forward measurably (see
    benchmarks/results/extract_speed.md).
    """
    with _JOURNAL_LOCK, open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, sort_keys=True) + "\n")


def _shard_intact(directory: Path, entry: dict[str, Any]) -> str | None:
    """None when the shard file matches its recorded size and sha256, else why not."""
    path = directory / entry["file"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, expected {entry['bytes']}"
    if sha256_file(path) != entry["sha256"]:
        return "sha256 differs"
    return None


@dataclass
class ResumeState:
    """Shards kept from an earlier run (index -> journal entry) and the plan they belong to."""

    key: str
    plan: list[list[int]]
    kept: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def todo(self) -> list[int]:
        """Indices of the shards that still have to be computed."""
        return [index for index in range(len(self.plan)) if index not in self.kept]

    @property
    def complete(self) -> bool:
        return not self.todo


def _entries_from_manifest(out: Path, key: str) -> list[dict[str, Any]] | None:
    """Journal-like entries of a published cache built with the same plan key, else None."""
    try:
        manifest = cache_manifest.read(out)
    except CacheError as error:
        log.warning("not resuming from %s, this run rebuilds it: %s", out, error)
        return None
    if manifest is None or manifest.get("plan_key") != key:
        return None
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for sample in manifest["samples"]:
        by_shard.setdefault(sample["shard"], []).append(sample)
    return [
        {**shard, "index": index, "samples": by_shard.get(shard["file"], []), "backend": manifest["backend"]}
        for index, shard in enumerate(manifest["shards"])
    ]


def prepare_resume(out: Path, key: str, plan: list[list[int]], sample_ids: Sequence[str]) -> ResumeState:
    """Set up `<out>.partial/` for this plan and say which shards an earlier run already finished.

    A published cache `out` with the same key is taken over (its intact shards kept); work left
    under another key is discarded, since its shards hold other bytes.
    """
    work = partial_dir(out)
    state = ResumeState(key=key, plan=plan)
    entries = None
    if (work / PLAN).is_file() and json.loads((work / PLAN).read_text()).get("plan_key") == key:
        entries = read_journal(work / JOURNAL)
        source = work
    else:
        if work.exists():
            log.info("%s holds work for other inputs; starting afresh", work)
            shutil.rmtree(work)
        published = _entries_from_manifest(out, key)
        if published is not None:
            os.replace(out, work)  # keep its shards; the cache is republished when complete
            (work / MANIFEST).unlink()
            entries, source = published, work
        work.mkdir(parents=True, exist_ok=True)
        (work / PLAN).write_text(json.dumps({"plan_key": key}) + "\n")
        (work / JOURNAL).unlink(missing_ok=True)
        for entry in entries or []:
            append_journal(work / JOURNAL, entry)
    latest: dict[int, dict[str, Any]] = {}  # a shard redone after a resume appears again later
    for entry in entries or []:
        index = entry.get("index")
        if isinstance(index, int) and 0 <= index < len(plan):
            latest[index] = entry
    redo: list[str] = []
    for index, entry in sorted(latest.items()):
        planned = [str(sample_ids[i]) for i in plan[index]]
        if [s["id"] for s in entry["samples"]] != planned:
            redo.append(f"{entry['file']} (holds other samples)")
            continue
        problem = _shard_intact(source, entry)
        if problem:
            redo.append(f"{entry['file']} ({problem})")
            continue
        state.kept[index] = entry
    if state.kept or redo:
        log.info(
            "resuming %s: %d of %d shards already complete and verified; redoing %d%s",
            out,
            len(state.kept),
            len(plan),
            len(state.todo),
            f", of them {', '.join(redo)}" if redo else "",
        )
    return state
