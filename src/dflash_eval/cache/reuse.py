"""Reusing the hidden states of the last published cache in a rerun, whatever Snakemake removed.

Many reruns of an extraction need little or no GPU time: a prompt appended (one new sample), the
completions rewritten with the same records (a fetch rerun that reused them all), another
`shard_tokens`, `snakemake --forcerun`. Snakemake deletes the cache directory before the job runs,
so every published cache is also hard-linked into `<out>.kept/` (no extra disk while both exist).
A sample's states depend on its own token ids and on the state key (target weights and config,
layers, argmax, device type, backend, package versions, the capture code), not on the other samples
or the shard layout; so a rerun with the same state key copies the rows of every sample whose token
ids are unchanged from there, each kept shard checked against its sha256 first, and runs the target
only on the rest (not at all, and without pausing the server, when nothing is left).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.manifest import MANIFEST, CacheError
from dflash_eval.io_utils import sha256_file
from dflash_eval.provenance.identity import STATE_CODE, module_code

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]
# The one migration (docs/reruns.md, "Upgrading"): the kept states' code key as the two earlier rules made it, on
# today's code, accepted so that the first rerun after the upgrade copies kept states instead of computing them when
# STATE_CODE's code is unchanged. The last release's: raw bytes of these files. The rule before the layout-free one:
# each STATE_CODE module's docstring-free code keyed by its module name.
_LEGACY_STATE_FILES = ("extract/capture.py", "extract/backends.py", "extract/target.py")
# Modules this release moved that STATE_CODE imports, as the name-keyed rule saw them (it hashed import lines):
# the import line is read back with the old module name, so the move alone recomputes no state.
_MOVED_SINCE_NAME_KEYED = {"dflash_eval.speedup.forwards.hybrid_target": "dflash_eval.speedup.static_hybrid"}
_HASH_THREADS = 4  # sha256 releases the GIL; a few threads keep up with a fast disk


def kept_dir(out: Path) -> Path:
    """Where the last published cache of `out` stays linked for the next rerun."""
    return out.with_name(f"{out.name}.kept")


def legacy_state_code_hashes() -> tuple[str, ...]:
    """The kept states' code keys of the earlier rules, on today's code: the release before code identities'
    (sha256 of the three files' bytes), and the rule that keyed each module's code by its name."""
    release = hashlib.sha256()
    for name in _LEGACY_STATE_FILES:
        release.update(name.encode() + b"\n" + (_PACKAGE / name).read_bytes())
    by_name = hashlib.sha256(b"version 1\n")
    for name in sorted(STATE_CODE):
        by_name.update(f"{name}\n{hashlib.sha256(name_keyed_code(name).encode()).hexdigest()}\n".encode())
    return release.hexdigest(), "sha256:" + by_name.hexdigest()[:16]


def name_keyed_code(name: str) -> str:
    """A STATE_CODE module's code as the name-keyed rule hashed it: today's code, its moved imports named as then."""
    code = module_code(name)
    for moved, before in _MOVED_SINCE_NAME_KEYED.items():
        code = code.replace(f"from {moved} import ", f"from {before} import ")
    return code


def keep_published(out: Path) -> None:
    """Hard-link the published cache's shards and manifest into `<out>.kept/`, replacing the
    previous ones.

    Where the file system has no hard links the cache is not kept (a copy would double its disk).
    """
    kept = kept_dir(out)
    tmp, old = kept.with_name(f"{kept.name}.tmp-{os.getpid()}"), kept.with_name(f"{kept.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for file in out.iterdir():
            if file.name == MANIFEST or file.suffix == ".safetensors":
                os.link(file, tmp / file.name)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning(
            "%s: not kept for reruns (hard links failed: %s); a rerun after Snakemake removes the cache "
            "extracts everything again",
            out,
            error,
        )
        return
    if kept.exists():
        os.replace(kept, old)
    os.replace(tmp, kept)
    shutil.rmtree(old, ignore_errors=True)


class KeptStates:
    """The samples of `<out>.kept/` that a rerun with `state_key` may copy instead of computing."""

    def __init__(self, out: Path, state_key: str, also: Sequence[str] = ()) -> None:
        """`also`: other state keys that name the same states (the keys the earlier rules made: the migration)."""
        self.directory = kept_dir(out)
        self.manifest: dict[str, Any] | None = None
        self.usable: dict[str, dict[str, Any]] = {}  # sample id -> kept manifest entry, tokens and shard checked
        try:
            manifest = cache_manifest.read(self.directory)
        except (OSError, CacheError):
            return
        if manifest is None:
            return
        if manifest.get("state_key") not in (state_key, *also):
            log.info(
                "%s: kept states are from other inputs (target, layers, backend, versions or code); not reused",
                self.directory,
            )
            return
        self.manifest = manifest
        if manifest.get("state_key") != state_key:
            log.info(
                "%s: kept states were keyed by an earlier rule's state code key; the code is the same, so "
                "they are reused (once: the new cache carries this release's key)",
                self.directory,
            )

    def find(self, records: Sequence[dict[str, Any]], store_argmax: bool) -> int:
        """Mark each record whose kept sample has the same token ids in an intact shard; how many."""
        if self.manifest is None or (store_argmax and not self.manifest.get("store_argmax")):
            return 0
        by_id = {s["id"]: s for s in self.manifest["samples"]}
        candidates: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for record in records:
            entry = by_id.get(str(record["id"]))
            if (
                entry is not None
                and entry["length"] == _length(record)
                and entry["prompt_len"] == len(record["prompt_token_ids"])
            ):
                candidates.setdefault(entry["shard"], []).append((record, entry))
        shards = {s["file"]: s for s in self.manifest["shards"]}
        with ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="kept-sha256") as pool:
            intact = dict(zip(candidates, pool.map(lambda f: self._intact(shards.get(f)), candidates)))
        for file, pairs in candidates.items():
            if not intact[file]:
                continue
            with safe_open(str(self.directory / file), framework="pt") as handle:
                input_ids = handle.get_tensor("input_ids")
            for record, entry in pairs:
                ids = record["prompt_token_ids"] + record["completion_token_ids"]
                if input_ids[entry["offset"] : entry["offset"] + entry["length"]].tolist() == ids:
                    self.usable[str(record["id"])] = entry
        return len(self.usable)

    def _intact(self, shard: dict[str, Any] | None) -> bool:
        if shard is None:
            return False
        path = self.directory / shard["file"]
        try:
            ok = path.stat().st_size == shard["bytes"] and sha256_file(path) == shard["sha256"]
        except OSError:
            ok = False
        if not ok:
            log.warning("%s: damaged (size or sha256 differs from its manifest); its samples are computed again", path)
        return ok

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.usable

    def states(
        self,
        sample_id: str,
        layer_ids: Sequence[int],
        store_argmax: bool,
        device: torch.device,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """Token ids, layer states and argmax of a usable kept sample, on `device` (as a forward leaves them)."""
        entry = self.usable[sample_id]
        rows = slice(entry["offset"], entry["offset"] + entry["length"])
        try:
            with safe_open(str(self.directory / entry["shard"]), framework="pt") as handle:
                tokens = handle.get_slice("input_ids")[rows]
                states = {i: handle.get_slice(f"layer.{i}")[rows] for i in layer_ids}
                argmax = handle.get_slice("argmax")[rows] if store_argmax else None
        except SafetensorError as error:  # it was intact a moment ago: something is writing to it
            raise OSError(f"{self.directory / entry['shard']}: unreadable while reusing it ({error})") from None
        move = (lambda t: t.to(device, non_blocking=True)) if device.type == "cuda" else (lambda t: t)
        return move(tokens), {i: move(s) for i, s in states.items()}, None if argmax is None else move(argmax)


def _length(record: dict[str, Any]) -> int:
    return len(record["prompt_token_ids"]) + len(record["completion_token_ids"])
