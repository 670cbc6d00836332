"""Resumable extraction: a killed run keeps its finished shards; corrupt shards are found and redone."""

import json
import random

import pytest
import torch

from dflash_eval.cache.resume import (
    JOURNAL,
    greedy_shards,
    partial_dir,
    plan_shards,
    read_journal,
)
from dflash_eval.cache.store import HiddenCache
from dflash_eval.cache.writer import CacheWriter
from dflash_eval.extract import stage as extract_stage
from tests.support.extract_runs import Counting, extract_settings
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4, 12, 3, 6, 8, 2, 5]  # with shard_tokens 10: one sample longer than a shard


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


@pytest.fixture
def completions(tmp_path):
    rng = random.Random(0)
    records = []
    for index, length in enumerate(LENGTHS):
        ids = [rng.randrange(2, 290) for _ in range(length)]
        records.append(
            {
                "id": f"s{index}",
                "prompt_token_ids": ids[:2],
                "completion_token_ids": ids[2:],
                "completion_ids_source": "server",
                "token_check": {},
            }
        )
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _shards(out):
    return {s["file"]: s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]}


def _pack(tmp_path, name, lengths, plan=None):
    """Samples through a CacheWriter (closing shards where `plan` says, if given); sample indices per shard."""
    out = tmp_path / name
    with CacheWriter(
        out,
        layer_ids=[0],
        shard_tokens=10,
        store_argmax=False,
        header={"target": {}, "backend": {}, "device": "cpu", "completions": {}},
    ) as writer:
        for shard in plan or [range(len(lengths))]:
            for index in shard:
                writer.add(f"s{index}", torch.arange(lengths[index]), {0: torch.zeros(lengths[index], 4)}, None, 1)
            writer.close_shard()
        writer.finish()
    by_shard: dict[str, list[int]] = {}
    for sample in HiddenCache(out).samples:
        by_shard.setdefault(sample["shard"], []).append(int(sample["id"][1:]))
    return [by_shard[name] for name in sorted(by_shard)]


def test_the_writer_packs_shards_exactly_as_planned(tmp_path):
    rng = random.Random(1)
    for trial in range(20):
        lengths = [rng.randint(1, 14) for _ in range(rng.randint(1, 12))]
        plan = plan_shards(lengths, 10)
        assert [i for shard in plan for i in shard] == list(range(len(lengths)))
        assert all(len(shard) == 1 or sum(lengths[i] for i in shard) <= 10 for shard in plan), (lengths, plan)
        assert _pack(tmp_path, f"planned{trial}", lengths, plan) == plan, lengths
        # Left to itself, the writer fills shards greedily: the rule the plan uses before its tail.
        assert _pack(tmp_path, f"greedy{trial}", lengths) == greedy_shards(lengths, 10), lengths


def test_the_plan_ends_in_shards_of_halving_size():
    """The last shard is written after the last forward; the tail keeps it to about one sample."""
    assert plan_shards(LENGTHS, 10) == [[0], [1], [2], [3], [4], [5, 6], [7], [8], [9]]  # tail: 2 + 5 tokens
    assert [len(shard) for shard in plan_shards([2048] * 64, 16384)] == [8] * 7 + [4, 2, 1, 1]
    assert [len(shard) for shard in plan_shards([8192] * 16, 16384)] == [2] * 7 + [1, 1]
    assert plan_shards([3, 3, 3], 10) == [[0], [1], [2]]
    assert plan_shards([20], 10) == [[0]] and plan_shards([], 10) == []


def _clean_and_killed(target_dir, completions, tmp_path, monkeypatch):
    """An uninterrupted cache, and the cache dir of a run killed at its 7th forward (shard [5, 6] open)."""
    clean = tmp_path / "clean"
    extract_stage.extract(extract_settings(target_dir), completions, clean)
    out = tmp_path / "hidden"
    with monkeypatch.context() as patch:
        Counting(patch, stop_at=6)
        with pytest.raises(KeyboardInterrupt):
            extract_stage.extract(extract_settings(target_dir), completions, out)
    return clean, out


def test_a_killed_run_resumes_with_only_the_missing_shards(target_dir, completions, tmp_path, monkeypatch, caplog):
    clean, out = _clean_and_killed(target_dir, completions, tmp_path, monkeypatch)
    assert not out.exists()
    journaled = read_journal(partial_dir(out) / JOURNAL)
    # plan: [0] [1] [2] [3] [4] [5, 6] [7] [8] [9]; the kill came at sample 6 with shard [5, 6] open
    assert plan_shards(LENGTHS, 10) == [[0], [1], [2], [3], [4], [5, 6], [7], [8], [9]]
    assert sorted(e["index"] for e in journaled) == [0, 1, 2, 3, 4]  # two writer threads: any order

    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir), completions, out)
    assert "5 of 9 shards already complete and verified; redoing 4" in caplog.text
    assert counter.calls == len(LENGTHS) - 5  # samples 5.. ran again, 5 because its shard was open
    assert not partial_dir(out).exists()
    cache = HiddenCache(out)
    cache.verify()
    assert cache.manifest["resumed_shards"] == 5
    assert _shards(out) == _shards(clean)  # the same bytes as an uninterrupted run
    assert sorted(p.name for p in out.iterdir()) == sorted([*_shards(clean), "manifest.json"])


def test_a_journaled_shard_whose_bytes_never_reached_the_disk_is_redone(
    target_dir, completions, tmp_path, monkeypatch, caplog
):
    """Shards and journal lines are not fsynced: after a power loss a line can outlive its bytes.

    What such a loss leaves (the file's size kept, its blocks zeros, or the file gone) must be
    found by the resume check and redone, never adopted.
    """
    clean, out = _clean_and_killed(target_dir, completions, tmp_path, monkeypatch)
    work = partial_dir(out)
    zeroed = work / "shard_00002.safetensors"
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    (work / "shard_00003.safetensors").unlink()
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir), completions, out)
    assert "shard_00002.safetensors (sha256 differs)" in caplog.text
    assert "shard_00003.safetensors (missing)" in caplog.text
    assert counter.calls == len(LENGTHS) - 3  # shards 0, 1 and 4 (one sample each) kept
    HiddenCache(out).verify()
    assert _shards(out) == _shards(clean)


def test_a_corrupt_shard_of_a_published_cache_is_found_and_redone(
    target_dir, completions, tmp_path, monkeypatch, caplog
):
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    expected = _shards(out)
    victim = out / "shard_00004.safetensors"
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated
    other = out / "shard_00001.safetensors"
    data = bytearray(other.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    other.write_bytes(bytes(data))
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir), completions, out)
    assert "shard_00004.safetensors (" in caplog.text and "expected" in caplog.text
    assert "shard_00001.safetensors (sha256 differs)" in caplog.text
    plan = plan_shards(LENGTHS, 10)
    assert counter.calls == len(plan[1]) + len(plan[4])
    HiddenCache(out).verify()
    assert _shards(out) == expected


def test_a_complete_cache_is_republished_without_loading_the_model(target_dir, completions, tmp_path, monkeypatch):
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    expected = _shards(out)
    monkeypatch.setattr(extract_stage, "load_target", lambda *a, **k: pytest.fail("model loaded"))
    extract_stage.extract(extract_settings(target_dir), completions, out)
    assert _shards(out) == expected
    assert HiddenCache(out).manifest["resumed_shards"] == len(expected)


def test_other_inputs_start_afresh_and_a_torn_journal_line_is_dropped(
    target_dir, completions, tmp_path, monkeypatch, caplog
):
    out = tmp_path / "hidden"
    with monkeypatch.context() as patch:
        Counting(patch, stop_at=6)
        with pytest.raises(KeyboardInterrupt):
            extract_stage.extract(extract_settings(target_dir), completions, out)
    with open(partial_dir(out) / JOURNAL, "a") as handle:
        handle.write('{"file": "shard_00003.safe')  # killed mid-append
    assert len(read_journal(partial_dir(out) / JOURNAL)) == 5
    assert "torn journal line dropped" in caplog.text

    counter = Counting(monkeypatch)
    extract_stage.extract(extract_settings(target_dir, layer_ids=[1, 3]), completions, out)  # another layer set
    assert counter.calls == len(LENGTHS)
    assert HiddenCache(out).layer_ids == [1, 3]
