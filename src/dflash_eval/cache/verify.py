"""Checking the hidden-cache shards an evaluation reads against the sha256 their manifest records.

A few flipped bits in a shard change a drafter's tau without any error: nothing else looks at the
bytes after extraction. Hashing a shard is one sequential read plus sha256 (its cost:
benchmarks/results/verify_cost.md), so
each shard is hashed on a background thread the first time the evaluation touches it: the read also
fills the page cache that the evaluation's own reads then hit, and the hash runs beside the drafter's
forwards. Results are checked as they come and all of them before metrics are written, so a damaged
shard never yields a metrics.json; the error names the shard and the command that repairs it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.manifest import CacheError
from dflash_eval.io_utils import sha256_file


def repair_command(directory: Path, manifest: dict[str, Any] | None = None) -> str:
    """How to rebuild a damaged cache: the extraction keeps every shard whose sha256 still matches."""
    manifest = manifest or {}
    layers = ",".join(str(i) for i in manifest.get("layer_ids", [])) or "<ids>"
    completions = (manifest.get("completions") or {}).get("path") or "results/completions/<dataset>.jsonl"
    return (
        f"rebuild it with `snakemake --forcerun {directory}` (the extraction keeps the intact shards and "
        f"recomputes only the damaged ones), or by hand `dflash-eval extract --config config.yaml --dataset "
        f"{manifest.get('dataset') or '<dataset>'} --layers {layers} --completions {completions} --out {directory}`"
    )


class ShardDamaged(CacheError):
    """A cache shard whose bytes are not the ones its manifest records."""


class ShardVerifier:
    """Hashes each shard once, in the background, the first time it is read; `check` raises for a mismatch."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._expected = {s["file"]: s for s in manifest["shards"]}
        self._pending: dict[str, Future[str]] = {}
        self.verified: dict[str, str] = {}  # file -> sha256, once it matched
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")

    def touch(self, file: str) -> None:
        """Note that `file` is being read: hash it unless that is done or under way; report finished ones."""
        if file not in self._pending and file not in self.verified:
            self._pending[file] = self._pool.submit(sha256_file, self.directory / file)
        self.check(wait=False)

    def check(self, wait: bool = True) -> dict[str, str]:
        """Compare the finished hashes (all of them when `wait`) with the manifest; file -> sha256 verified."""
        for file, future in list(self._pending.items()):
            if not wait and not future.done():
                continue
            del self._pending[file]
            digest = future.result()
            if digest != self._expected[file]["sha256"]:
                self._pool.shutdown(wait=False, cancel_futures=True)
                raise ShardDamaged(
                    f"{self.directory / file}: sha256 differs from the manifest ({digest[:12]}... instead of "
                    f"{self._expected[file]['sha256'][:12]}...): the shard is damaged (disk, copy or edit), so nothing "
                    f"was evaluated from it; {repair_command(self.directory, self.manifest)}"
                )
            self.verified[file] = digest
        if wait:
            self._pool.shutdown(wait=True)
        return dict(self.verified)

    def record(self) -> list[dict[str, Any]]:
        """What was verified, for metrics.json: each shard's file, sha256, size and mtime when it was read."""
        rows = []
        for file, digest in sorted(self.check().items()):
            stat = os.stat(self.directory / file)
            rows.append({"file": file, "sha256": digest, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return rows


def changed_since_extraction(directory: Path) -> list[str]:
    """Shards of a published cache whose size or mtime differ from what its manifest recorded at extraction.

    Cheap (one stat a shard), so the workflow asks at every start: a shard edited or damaged by a copy
    after extraction shows up in `snakemake -n`, before an evaluation reads it. Caches written before
    the manifest recorded mtimes are not checked here (their evaluations still hash every shard).
    """
    try:
        manifest = cache_manifest.read(directory)
    except (OSError, CacheError):
        return []
    if manifest is None:
        return []
    changed = []
    for shard in manifest.get("shards", []):
        if "mtime_ns" not in shard:
            continue
        try:
            stat = os.stat(directory / shard["file"])
        except OSError:
            changed.append(f"{directory / shard['file']} (missing)")
            continue
        if stat.st_size != shard["bytes"] or stat.st_mtime_ns != shard["mtime_ns"]:
            changed.append(f"{directory / shard['file']} (size or modification time differs from the manifest's)")
    return changed
