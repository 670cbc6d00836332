"""manifest.json of a hidden cache (docs/contracts.md): the one place that writes and reads it.

The cache writer (cache.writer.CacheWriter) builds and writes it; evaluate opens it strictly
(`load`, through cache.store.HiddenCache), resume and the report read it as it is (`read`: None
when absent). Only JSON here, no torch, so that the report stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
HEADER_KEYS = ("target", "backend", "device", "completions")  # what the extract stage must give the writer
_SAMPLE_KEYS = ("id", "shard", "offset", "length", "prompt_len")
_SHARD_KEYS = ("file", "sha256", "bytes", "tokens")


class CacheError(DflashEvalError):
    """A hidden cache that is missing, malformed, corrupt, or being written with bad data."""


def manifest_path(directory: str | Path) -> Path:
    return Path(directory) / MANIFEST


def build(
    header: dict[str, Any],
    layer_ids: Sequence[int],
    store_argmax: bool,
    samples: list[dict[str, Any]],
    shards: list[dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of a finished cache; `header` is what the extract stage recorded (HEADER_KEYS at least)."""
    missing = [key for key in HEADER_KEYS if key not in header]
    if missing:
        raise CacheError(f"manifest header lacks {missing}")
    return {
        "format_version": FORMAT_VERSION,
        **header,
        "layer_ids": layer_ids,
        "store_argmax": store_argmax,
        "samples": samples,
        "shards": shards,
    }


def write(directory: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(manifest_path(directory), manifest)


def read(directory: str | Path) -> dict[str, Any] | None:
    """The manifest as written, unchecked; None when the directory has none. Not JSON: an error naming it."""
    path = manifest_path(directory)
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise CacheError(f"{path}: not valid JSON ({error}); re-run the extract stage to rebuild this cache") from None
    if not isinstance(manifest, dict):
        raise CacheError(f"{path}: not a JSON object; re-run the extract stage to rebuild this cache")
    return manifest


def load(directory: str | Path) -> dict[str, Any]:
    """The manifest of a cache to read states from: present, this format, consistent with its shards."""
    directory = Path(directory)
    manifest = read(directory)
    if manifest is None:
        what = "directory" if not directory.is_dir() else "manifest"
        raise CacheError(
            f"hidden cache {what} not found: {manifest_path(directory)}; build it with the extract stage "
            "(snakemake ... or `dflash-eval extract --completions ... --out DIR`)"
        )
    _validate(directory, manifest)
    return manifest


def entry(directory: str | Path, manifest: dict[str, Any], dotted: str) -> Any:
    """manifest["a"]["b"] for "a.b"; absent: an error naming the key and the file (a reader's own need)."""
    value: Any = manifest
    for key in dotted.split("."):
        _require(isinstance(value, dict) and key in value, Path(directory), f"missing key {dotted!r}")
        value = value[key]
    return value


def _require(condition: bool, directory: Path, what: str) -> None:
    if not condition:
        raise CacheError(f"{manifest_path(directory)}: {what}; re-run the extract stage to rebuild this cache")


def _validate(d: Path, m: dict[str, Any]) -> None:
    _require(
        m.get("format_version") == FORMAT_VERSION,
        d,
        f"format_version {m.get('format_version')!r}, this reader understands {FORMAT_VERSION}",
    )
    for key in (*HEADER_KEYS, "layer_ids", "store_argmax", "samples", "shards"):
        _require(key in m, d, f"missing key {key!r}")
    _require(
        isinstance(m["layer_ids"], list) and all(isinstance(i, int) for i in m["layer_ids"]),
        d,
        "layer_ids must be integers",
    )
    for name, keys in (("samples", _SAMPLE_KEYS), ("shards", _SHARD_KEYS)):
        _require(isinstance(m[name], list), d, f"{name} must be a list")
        for index, entry in enumerate(m[name]):
            absent = [key for key in keys if not isinstance(entry, dict) or key not in entry]
            _require(not absent, d, f"{name}[{index}] lacks {absent}")
    shards = {s["file"]: s for s in m["shards"]}
    for name in shards:
        _require((d / name).is_file(), d, f"shard {name} is listed but missing")
    ids = [s["id"] for s in m["samples"]]
    _require(len(set(ids)) == len(ids), d, "sample ids repeat")
    for s in m["samples"]:
        shard = shards.get(s["shard"])
        _require(
            shard is not None and 0 <= s["offset"] and s["offset"] + s["length"] <= shard["tokens"],
            d,
            f"sample {s['id']!r} points outside its shard {s['shard']}",
        )
