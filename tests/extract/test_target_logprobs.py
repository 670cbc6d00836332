"""The target log-probs the rejection scheme needs, stored by the extract stage only when asked for: each
completion token's log-probability under dflash 0.1.0's `_sampling_probs` of an independent Hugging Face
forward, NaN at prompt positions; greedy or min-p records are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from dflash_eval.cache.store import LOGPROB_KEY, HiddenCache
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.stage import extract
from tests.support.extract_runs import extract_settings, tiny_records, write_records
from tests.support.tiny import tiny_target

SAMPLING = [
    {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "seed": 1},
    {"temperature": 1.0, "top_p": 1.0, "top_k": 20, "min_p": 0.0, "seed": None},
    {"temperature": 0.5, "top_p": 0.95, "top_k": 50, "min_p": 0.0, "seed": 3},
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


def _sampled(lengths):
    records = tiny_records(lengths)
    for record, sampling in zip(records, SAMPLING):
        record["sampling"] = dict(sampling)
    return records


def test_stored_logprobs_equal_dflash_sampling_probs_of_a_plain_forward(tmp_path, target_dir):
    from dflash.model import _sampling_probs

    records = _sampled([7, 12, 9])  # shards of 10 tokens: the 12-token sample has one of its own
    out = extract(
        extract_settings(target_dir, target_logprobs=True),
        write_records(tmp_path / "c.jsonl", records),
        tmp_path / "cache",
    )
    cache = HiddenCache(out, verify=True)
    assert cache.target_logprobs["convention"] == "dflash"
    model = tiny_target()
    for record, sampling in zip(records, SAMPLING):
        ids = record["prompt_token_ids"] + record["completion_token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        probs = _sampling_probs(logits[:-1], sampling["temperature"], sampling["top_p"], max(sampling["top_k"], 0))
        expected = probs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].log()
        stored = cache.load_sample(record["id"]).logprob
        prompt_len = len(record["prompt_token_ids"])
        assert torch.isnan(stored[:prompt_len]).all()
        torch.testing.assert_close(stored[prompt_len:], expected[prompt_len - 1 :], rtol=1e-5, atol=1e-5)
    cache.verify()


def test_no_logprobs_unless_asked(tmp_path, target_dir):
    out = extract(
        extract_settings(target_dir), write_records(tmp_path / "c.jsonl", _sampled([7, 9])), tmp_path / "cache"
    )
    cache = HiddenCache(out)
    assert cache.target_logprobs is None and cache.load_sample("s0").logprob is None
    from safetensors import safe_open

    with safe_open(str(out / cache.samples[0]["shard"]), framework="pt") as handle:
        assert LOGPROB_KEY not in handle.keys()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda r: r.pop("sampling"), r"record 's1' was fetched greedily.*evaluation.verify: target_only"),
        (lambda r: r["sampling"].update(min_p=0.05), r"record 's1' was sampled with min_p 0.05"),
    ],
)
def test_unscorable_records_are_refused_before_the_forward(tmp_path, target_dir, change, message):
    records = _sampled([7, 9])
    change(records[1])
    with pytest.raises(DflashEvalError, match=message):
        extract(
            extract_settings(target_dir, target_logprobs=True),
            write_records(tmp_path / "c.jsonl", records),
            tmp_path / "cache",
        )
    assert not (tmp_path / "cache").exists()


def test_an_interrupted_extraction_resumes_with_the_same_logprobs(tmp_path, target_dir, monkeypatch):
    from tests.support.extract_runs import Counting

    records = _sampled([7, 12, 9])
    completions = write_records(tmp_path / "c.jsonl", records)
    settings = extract_settings(target_dir, target_logprobs=True)
    whole = HiddenCache(extract(settings, completions, tmp_path / "whole"))
    Counting(monkeypatch, stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        extract(settings, completions, tmp_path / "cache")
    monkeypatch.undo()
    resumed = HiddenCache(extract(settings, completions, tmp_path / "cache"), verify=True)
    assert resumed.manifest.get("resumed_shards", 0) >= 1
    for record in records:
        torch.testing.assert_close(
            resumed.load_sample(record["id"]).logprob,
            whole.load_sample(record["id"]).logprob,
            equal_nan=True,
            rtol=0,
            atol=0,
        )
    resumed.verify()


def test_the_writer_refuses_missing_or_misshapen_logprobs(tmp_path):
    from dflash_eval.cache.writer import CacheError, CacheWriter

    header = {"target": {}, "backend": {}, "device": "cpu", "completions": {}}
    states = {0: torch.zeros(4, 8)}
    with CacheWriter(
        tmp_path / "a", layer_ids=[0], shard_tokens=10, store_argmax=False, header=header, store_logprob=True
    ) as writer:
        with pytest.raises(CacheError, match=r"sample 'x': target log-probs missing"):
            writer.add("x", torch.arange(4), states, None, 2)
        with pytest.raises(CacheError, match=r"sample 'y': target log-probs \(3,\), expected \(4,\)"):
            writer.add("y", torch.arange(4), states, None, 2, torch.zeros(3))
    with CacheWriter(tmp_path / "b", layer_ids=[0], shard_tokens=10, store_argmax=False, header=header) as writer:
        with pytest.raises(CacheError, match=r"sample 'z': target log-probs \(4,\).*here False"):
            writer.add("z", torch.arange(4), states, None, 2, torch.zeros(4))
