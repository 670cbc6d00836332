"""Finished evaluations kept by content, so a job of several checkpoints recomputes only what changed.

With `evaluation.checkpoints_per_job` above 1 one Snakemake job evaluates several checkpoints in one process
(torch, CUDA and the imports paid once). Snakemake reruns such a job as a whole and removes all of its outputs
first, so each checkpoint's finished metrics.json and samples.csv are also kept here, beside the outputs, under
a key over everything the evaluation reads: its settings, the checkpoint's and the target's file contents, the
cache's manifest and shard files, the completions, the serving profile, the evaluate stage's code and the
numeric packages' versions. A job restores a checkpoint whose key is unchanged (byte for byte what it would
compute) and evaluates the others; a job that fails or is interrupted keeps every checkpoint it finished.

Layout: `<store>/<drafter>/<dataset>/{key.json, metrics.json, samples.csv}`, the newest evaluation only (a
changed checkpoint replaces its entry). Deleting the folder forces every evaluation to run again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_bytes, sha256_file

log = logging.getLogger(__name__)

FILES = ("metrics.json", "samples.csv")
KEY_FILE = "key.json"
_FORMAT = 1


def key_parts(settings: dict, hidden: str | Path, completions: str | Path) -> dict:
    """Everything an evaluation's outputs depend on, as plain data (key.json holds it, for a reader's diff)."""
    import numpy
    import torch

    from dflash_eval.provenance.fingerprint import checkpoint_sha256
    from dflash_eval.provenance.identity import stage_identity

    checkpoint = settings["checkpoint"]
    hidden = Path(hidden)
    manifest = hidden / "manifest.json"
    if not manifest.is_file():
        raise DflashEvalError(f"{hidden}: no manifest.json; re-run extraction for this cache")
    profile = (settings.get("speedup") or {}).get("profile")
    return {
        "format": _FORMAT,
        "settings": settings,
        "checkpoint": checkpoint_sha256(checkpoint["path"]),
        "checkpoint_config": sha256_file(checkpoint["config"]) if checkpoint.get("config") else None,
        "target": checkpoint_sha256(settings["target"]["path"]),  # every file of the directory (cached hashes)
        "cache_manifest": sha256_file(manifest),
        # the shards as they lie now (the evaluation checks each against the manifest's sha256 as it reads it;
        # a restore reads none, so a shard rewritten since is caught by its size and mtime here)
        "cache_files": sorted(
            [p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in hidden.iterdir()
            if p.is_file() and p.name != "manifest.json"
        ),
        "completions": sha256_file(completions),
        "profile": sha256_file(profile) if profile else None,
        "code": stage_identity("evaluate"),
        "packages": {"torch": torch.__version__, "numpy": numpy.__version__},
    }


def key_of(parts: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ResultStore:
    """The store folder: `restore` a finished evaluation by key, `save` one just written."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def entry(self, drafter: str, dataset: str) -> Path:
        return self.root / drafter / dataset

    def restore(self, drafter: str, dataset: str, key: str, outputs: dict[str, str | Path]) -> bool:
        """Copy the entry's files to `outputs` (file name -> path) when its key is `key`; False otherwise."""
        entry = self.entry(drafter, dataset)
        try:
            stored = json.loads((entry / KEY_FILE).read_text())
        except (OSError, ValueError):
            return False  # none yet, or damaged: the evaluation runs and replaces it
        if stored.get("key") != key or not all((entry / name).is_file() for name in FILES):
            return False
        for name in FILES:
            atomic_write_bytes(outputs[name], (entry / name).read_bytes())
        return True

    def save(self, drafter: str, dataset: str, key: str, parts: dict, outputs: dict[str, str | Path]) -> None:
        """Keep the outputs just written under `key`, replacing the entry's older evaluation.

        The files go to a fresh folder that is then renamed into place: a crash leaves the old entry, no entry,
        or the new one, never a mix (a missing or older entry only costs an evaluation)."""
        entry = self.entry(drafter, dataset)
        entry.parent.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=f".{dataset}.", dir=entry.parent))
        try:
            for name in FILES:
                shutil.copyfile(outputs[name], fresh / name)
            (fresh / KEY_FILE).write_text(json.dumps({"key": key, "parts": parts}, indent=1, sort_keys=True) + "\n")
            os.chmod(fresh, 0o777 & ~_umask())
            old = entry.with_name(f".{dataset}.old")
            shutil.rmtree(old, ignore_errors=True)
            if entry.exists():
                entry.rename(old)
            fresh.rename(entry)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
