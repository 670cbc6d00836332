"""Extraction reruns that need no GPU hours, and bad hand-written settings: the real extract stage, a real tiny
target, real safetensors shards.

Snakemake removes the cache directory before it reruns extraction (here: `shutil.rmtree(out)`), so the reuse of
`<out>.kept/` is what keeps a rerun after an appended prompt or another `shard_tokens` from recomputing
everything; its states must be bit-identical to a fresh extraction's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_eval import cli
from dflash_eval.cache.reuse import kept_dir
from dflash_eval.cache.store import HiddenCache
from dflash_eval.extract import stage as extract_stage
from tests.support.extract_runs import (
    Counting,
    assert_same_states,
    cache_states,
    extract_settings,
    tiny_records,
    write_records,
)
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4, 12, 3, 6, 8, 2, 5]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


def test_a_rerun_after_snakemake_removed_the_cache_computes_only_new_or_changed_samples(
    target_dir, tmp_path, monkeypatch, caplog
):
    records = tiny_records(LENGTHS)
    completions = write_records(tmp_path / "c.jsonl", records)
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    assert kept_dir(out).is_dir() and all((kept_dir(out) / f.name).samefile(f) for f in out.iterdir()), (
        "kept as hard links of the published cache"
    )

    # one prompt appended, one completion changed, and another shard_tokens: only those two run the target
    changed = records + tiny_records([6], seed=9)[0:1]
    changed[-1]["id"] = "new"
    changed[3] = {**changed[3], "completion_token_ids": changed[3]["completion_token_ids"][:-1] + [7]}
    completions = write_records(tmp_path / "c.jsonl", changed)
    shutil.rmtree(out)  # what Snakemake does before it reruns the job
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir, shard_tokens=7), completions, out)
    assert counter.calls == 2
    assert "9 of the 11 samples still to do have unchanged token ids" in caplog.text
    assert HiddenCache(out).manifest["reused_samples"] == 9
    fresh = tmp_path / "fresh"
    extract_stage.extract(
        extract_settings(target_dir, shard_tokens=7), write_records(tmp_path / "f.jsonl", changed), fresh
    )
    assert_same_states(cache_states(out), cache_states(fresh))

    # nothing changed but the layout: no model, no server pause
    shutil.rmtree(out)
    monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("model loaded"))
    caplog.clear()
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir, shard_tokens=13), completions, out)
    assert "no forward needed" in caplog.text and "no inference server is paused" not in caplog.text
    assert_same_states(cache_states(out), cache_states(fresh))


def test_a_damaged_kept_shard_is_computed_again_and_other_inputs_reuse_nothing(
    target_dir, tmp_path, monkeypatch, caplog
):
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    clean = cache_states(out)
    kept_shard = kept_dir(out) / "shard_00004.safetensors"  # sample s4 alone (longer than a shard)
    data = bytearray(kept_shard.read_bytes())
    data[-5] ^= 0xFF
    shutil.rmtree(out)
    kept_shard.write_bytes(bytes(data))
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir), completions, out)
    assert counter.calls == 1 and "shard_00004.safetensors: damaged" in caplog.text
    assert_same_states(cache_states(out), clean)

    shutil.rmtree(out)  # other settings (no argmax stored) make another state key: nothing is reused
    counter = Counting(monkeypatch)
    extract_stage.extract(extract_settings(target_dir, store_argmax=False), completions, out)
    assert counter.calls == len(LENGTHS)


def test_a_kept_cache_under_the_other_last_layer_convention_is_recomputed(target_dir, tmp_path, monkeypatch):
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out, taps_last = tmp_path / "hidden", [0, 3]  # the tiny target has 4 layers: 3 is the last
    extract_stage.extract(extract_settings(target_dir, layer_ids=taps_last, last_layer="final_norm"), completions, out)
    final_norm = cache_states(out)
    shutil.rmtree(out)  # same completions, the other convention: the last layer's states are other values
    counter = Counting(monkeypatch)
    extract_stage.extract(extract_settings(target_dir, layer_ids=taps_last, last_layer="pre_norm"), completions, out)
    assert counter.calls == len(LENGTHS) and HiddenCache(out).manifest["reused_samples"] == 0
    pre_norm = cache_states(out)
    hidden = HiddenCache(out).manifest["target"]["hidden_size"]  # features: [T, layer 0 | layer 3]
    for key in final_norm:
        first, last = final_norm[key].features.split(hidden, dim=-1), pre_norm[key].features.split(hidden, dim=-1)
        assert torch.equal(first[0], last[0]) and not torch.equal(first[1], last[1])


def test_extraction_times_no_target_and_takes_no_timing_settings(target_dir, tmp_path):
    """The target is timed by its own rule (tools/profile_target.py): a cache holds states, its manifest and
    nothing else, and speedup settings given to extraction are refused as unknown (a typo stays loud)."""
    from dflash_eval.errors import DflashEvalError

    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    assert {p.name for p in out.iterdir() if p.suffix != ".safetensors"} == {"manifest.json"}
    assert {p.name for p in kept_dir(out).iterdir() if p.suffix != ".safetensors"} == {"manifest.json"}
    with pytest.raises(DflashEvalError, match="unknown"):
        extract_stage.extract(extract_settings(target_dir, speedup={"measure": True}), completions, tmp_path / "x")


def test_bad_hand_written_settings_are_named_not_raised(target_dir, tmp_path):
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS[:2]))
    log = tmp_path / "extract.log"
    settings = {**extract_settings(target_dir), "layer_ids": None}
    argv = [
        "--log",
        str(log),
        "extract",
        "--settings",
        json.dumps(settings),
        "--completions",
        str(completions),
        "--out",
        str(tmp_path / "out"),
    ]
    assert cli.main(argv) == 2
    assert "extract settings: missing ['layer_ids']" in log.read_text()  # a null counts as left out
    assert "Traceback" not in log.read_text()


def test_the_kernel_warm_up_runs_only_on_cuda(target_dir):
    """On a CPU nothing compiles: no warm-up forward; on CUDA one short forward before the timed ones (GPU tests)."""
    calls = []
    model = tiny_target()
    model.register_forward_hook(lambda *_: calls.append(1))
    assert extract_stage.warm_up(model, tiny_records([9]), torch.device("cpu")) == 0.0
    assert calls == []


@pytest.mark.gpu
def test_the_kernel_warm_up_is_one_short_forward_on_cuda(target_dir):
    calls = []
    model = tiny_target().to("cuda")
    model.register_forward_hook(lambda module, args, kwargs_or_out: calls.append(args[0].shape if args else None))
    assert extract_stage.warm_up(model, tiny_records([200]), torch.device("cuda")) >= 0.0
    assert len(calls) == 1
