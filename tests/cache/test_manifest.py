"""manifest.json: one writer and one reader, clear errors for a damaged one, and its readers share them."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dflash_eval.cache import manifest, resume, store
from dflash_eval.cache.manifest import CacheError
from dflash_eval.cache.resume import partial_dir, prepare_resume
from dflash_eval.cache.store import HiddenCache
from dflash_eval.cache.writer import CacheWriter
from dflash_eval.report import trust

HEADER = {
    "target": {"path": "t", "config_hash": "0" * 64},
    "backend": {"name": "torch"},
    "device": "cpu",
    "completions": {"path": "c.jsonl", "sha256": "1" * 64},
}


def _cache(tmp_path, name="cache"):
    out = tmp_path / name
    with CacheWriter(out, layer_ids=[0], shard_tokens=10, store_argmax=False, header=HEADER) as writer:
        writer.add("s0", torch.arange(3), {0: torch.zeros(3, 4)}, None, 1)
        writer.finish()
    return out


def test_written_manifest_reads_back_strictly_and_plainly(tmp_path):
    out = _cache(tmp_path)
    written = json.loads((out / "manifest.json").read_text())
    assert manifest.read(out) == manifest.load(out) == HiddenCache(out).manifest == written
    assert written["format_version"] == manifest.FORMAT_VERSION and written["samples"][0]["id"] == "s0"
    assert manifest.read(tmp_path / "nowhere") is None


def test_a_manifest_that_is_not_json_is_named(tmp_path):
    out = _cache(tmp_path)
    (out / "manifest.json").write_text('{"format_version": 1,')
    for read in (manifest.read, HiddenCache, lambda d: trust.cache_entry(d, None)):
        with pytest.raises(CacheError, match=r"cache/manifest.json: not valid JSON .*re-run the extract stage"):
            read(out)
    (out / "manifest.json").write_text("[]")
    with pytest.raises(CacheError, match="manifest.json: not a JSON object"):
        manifest.read(out)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["samples"][0].pop("prompt_len"), r"samples\[0\] lacks \['prompt_len'\]"),
        (lambda m: m["shards"][0].pop("tokens"), r"shards\[0\] lacks \['tokens'\]"),
        (lambda m: m.update(samples={}), "samples must be a list"),
        (lambda m: m.update(layer_ids=["0"]), "layer_ids must be integers"),
        (lambda m: m.pop("backend"), "missing key 'backend'"),
    ],
)
def test_a_malformed_manifest_is_refused_with_the_key(tmp_path, edit, message):
    """A hand-edited or foreign manifest: an error naming the key, never a bare KeyError."""
    out = _cache(tmp_path)
    data = json.loads((out / "manifest.json").read_text())
    edit(data)
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CacheError, match=f"manifest.json: {message}; re-run the extract stage"):
        HiddenCache(out)


def test_entry_names_a_missing_nested_key(tmp_path):
    out = _cache(tmp_path)
    assert manifest.entry(out, manifest.read(out), "target.config_hash") == "0" * 64
    with pytest.raises(CacheError, match=r"manifest.json: missing key 'backend.nope'"):
        manifest.entry(out, manifest.read(out), "backend.nope")


def test_the_writer_refuses_a_header_without_the_stage_keys(tmp_path):
    with pytest.raises(CacheError, match=r"manifest header lacks \['completions'\]"):
        manifest.build({k: v for k, v in HEADER.items() if k != "completions"}, [0], False, [], [])


def test_a_published_cache_with_a_damaged_manifest_is_rebuilt_not_a_crash(tmp_path, caplog):
    out = _cache(tmp_path)
    (out / "manifest.json").write_text("{torn")
    with caplog.at_level(logging.WARNING):
        state = prepare_resume(out, "key", [[0]], ["s0"])
    assert state.todo == [0] and not state.kept
    assert "not resuming from" in caplog.text and "not valid JSON" in caplog.text
    assert partial_dir(out).is_dir() and (out / "manifest.json").exists()  # replaced only when the rerun publishes


def test_one_name_for_the_manifest_file():
    assert store.cache_manifest is resume.cache_manifest is manifest and resume.MANIFEST == "manifest.json"
    assert store.CacheError is CacheError
