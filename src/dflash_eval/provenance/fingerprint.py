"""Content fingerprints of model files, hashed once and cached by path, size and mtime.

Why not let Snakemake compare checkpoints itself: Snakemake re-hashes every input file up to
`--max-checksum-file-size` at the end of every job (for every output) and again on every dry run
after a file was touched. With a 54 GB target as an input of hundreds of evaluations that is hours
of sha256. So the workflow passes external model files as a fingerprint *param* instead: a content
change changes the param (rerun), a touch or a copy with the same bytes does not (nothing to do),
and each file is read once until its size or mtime changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json, sha256_file

DEFAULT_CACHE = Path(".snakemake") / "dflash-eval" / "fingerprints.json"
_FORMAT = 1


class FingerprintCache:
    """sha256 per file, keyed by absolute path and valid while (size, mtime_ns) stay the same.

    `digest` is what is kept per file: the bytes' sha256 by default (provenance/identity.py keeps its code's)."""

    def __init__(self, path: str | Path = DEFAULT_CACHE, digest: Callable[[str], str] | None = None) -> None:
        self.path = Path(path)
        self._digest = digest
        self._entries: dict[str, list] = self._load()

    def _load(self) -> dict[str, list]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # a damaged cache only costs a re-hash
        return data.get("files", {}) if data.get("format") == _FORMAT else {}

    def file(self, path: str | Path, what: str = "file") -> str:
        """sha256 of one file; `what` names the config key in the error when the file is missing."""
        key = os.path.abspath(path)
        try:
            stat = os.stat(key)
        except FileNotFoundError:
            raise DflashEvalError(f"{what}: {path} does not exist (fix the path in config.yaml)") from None
        entry = self._entries.get(key)
        if entry and entry[0] == stat.st_size and entry[1] == stat.st_mtime_ns:
            return entry[2]
        digest = (self._digest or sha256_file)(key)
        self._entries[key] = [stat.st_size, stat.st_mtime_ns, digest]
        self._save()
        return digest

    def files(self, paths: list[str], what: str = "files") -> str:
        """One fingerprint for a set of files (a model directory): names and contents, order-free."""
        lines = sorted(f"{Path(p).name}\t{self.file(p, what)}" for p in paths)
        return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def _save(self) -> None:
        # Several Snakemake processes (cluster jobs re-parse the Snakefile) may write at once: the
        # rename keeps the file whole, and an entry lost to a race only costs one re-hash.
        try:
            atomic_write_json(self.path, {"format": _FORMAT, "files": self._entries})
        except OSError:
            pass  # a read-only working directory still gets correct (uncached) fingerprints


def checkpoint_sha256(path: str | Path) -> str:
    """metrics.json's checkpoint sha256: the file's own, or for a directory the sha256 of its files' hex
    digests concatenated in path order. Each file's digest goes through the FingerprintCache, where the
    workflow put it when it fingerprinted a checkpoint it did not build for this rule's param: no re-read."""
    target = Path(path)
    files = sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
    fingerprints = FingerprintCache()
    digests = [fingerprints.file(file, "checkpoint.path") for file in files]
    return digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
