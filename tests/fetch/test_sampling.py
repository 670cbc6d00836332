"""Fetch at temperature > 0: SGLang's request fields, n seeded completions per prompt, keying and refetch, the
lossless check; end to end against the demo server (SGLang's target-only sampled verify), whose completions and
counters must be the ones its loop gives for each record's recorded seed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dflash_eval.config import sampling_problems, validate_config
from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch import sampling, sglang
from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.settings import fetch_params
from dflash_eval.sglang_protocol import PROTOCOL_FIELDS
from tests.support.demo_server import BLOCK

REPO = Path(__file__).resolve().parents[2]
DRAWN = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "n": 2, "sampling_seed": 5}


OFF_PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def test_the_request_fields_are_sglangs():
    """seed, top_p, top_k, min_p, the penalties, temperature on both OpenAI request models (protocol.py), as fetch
    sends them: every field that decides the served distribution, off ones too, greedy requests the penalties."""
    settings = {**DRAWN, **OFF_PENALTIES}
    drawn = sampling.record_sampling(settings, "q#s0")
    common, extra = sampling.request_fields(settings, drawn, sglang=True)
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        assert {"temperature", *common, *extra} <= set(PROTOCOL_FIELDS[model]), model
    # sent "off" explicitly: unset would be generation_config's (repetition_penalty on the chat endpoint)
    assert extra == {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert common == {"top_p": 0.95, "seed": drawn["seed"], "frequency_penalty": 0.0, "presence_penalty": 0.0}
    assert sampling.request_fields(settings, drawn, sglang=False)[1] == {}  # a plain OpenAI server: what filters
    greedy = {"temperature": 0.0, **OFF_PENALTIES}
    assert sampling.request_fields(greedy, None, sglang=True) == (
        {"frequency_penalty": 0.0, "presence_penalty": 0.0},
        {"repetition_penalty": 1.0},
    )
    penalized = {**greedy, "repetition_penalty": 1.1}
    assert sampling.request_fields(penalized, None, sglang=False) == ({}, {"repetition_penalty": 1.1})
    assert "not SGLang" in sampling.defaults_warning(greedy, sglang=False)
    assert "repetition_penalty" in sampling.defaults_warning(greedy, sglang=False)
    assert sampling.defaults_warning(greedy, sglang=True) is None
    assert sampling.request_identity(greedy) == OFF_PENALTIES  # a record fetched without them is fetched again


def test_ids_and_seeds():
    assert sampling.sample_ids("q1#2", {**DRAWN, "n": 3}) == ["q1#2#s0", "q1#2#s1", "q1#2#s2"]
    assert sampling.sample_ids("q1", {"temperature": 0.0}) == ["q1"]
    seeds = {sampling.record_seed(5, f"q{i}#s{k}") for i in range(50) for k in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**31 for s in seeds)
    assert sampling.record_seed(5, "q1#s0") == sampling.record_seed(5, "q1#s0") != sampling.record_seed(6, "q1#s0")


def _repo_config() -> dict:
    import yaml

    return yaml.safe_load((REPO / "config.yaml").read_text())


def test_params_name_every_sampling_key():
    config = validate_config(_repo_config())
    greedy, sampled = fetch_params(config, "demo-code"), fetch_params(config, "demo-code-t07")
    keys = ("temperature", "top_p", "top_k", "min_p", "n")
    assert {k: greedy[k] for k in keys} == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1}
    assert {k: greedy[k] for k in OFF_PENALTIES} == OFF_PENALTIES  # the schema's off values, a dataset may set them
    penalized = validate_config(
        {
            **_repo_config(),
            "datasets": {"d": {"prompts": "resources/prompts/demo_code.jsonl", "repetition_penalty": 1.05}},
        }
    )
    assert fetch_params(penalized, "d")["repetition_penalty"] == 1.05
    assert {k: sampled[k] for k in keys} == {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "n": 1}


def test_sampling_keys_at_temperature_0_and_the_old_fetch_temperature_are_loud(caplog):
    assert sampling_problems({"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1}) == []
    problem = sampling_problems({"temperature": 0.0, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "n": 4})
    assert "top_p=0.9" in problem[0] and "n=4" in problem[0] and "temperature > 0" in problem[0]
    base = _repo_config()
    with pytest.raises(DflashEvalError, match=r"datasets\.demo-code: n=2 at temperature 0"):
        validate_config({**base, "datasets": {"demo-code": {**base["datasets"]["demo-code"], "n": 2}}})
    with pytest.raises(DflashEvalError, match=r"fetch\.temperature is 0\.7.*datasets\.<name>\.temperature"):
        validate_config({**base, "fetch": {**base["fetch"], "temperature": 0.7}})
    with caplog.at_level(logging.WARNING):
        assert "temperature" not in validate_config({**base, "fetch": {**base["fetch"], "temperature": 0.0}})["fetch"]
    assert "fetch.temperature is gone" in caplog.text


def test_the_lossless_check():
    spec = {"speculative_algorithm": "DFLASH"}
    drawn = sampling.record_sampling({**DRAWN, "min_p": 0.0}, "q")
    lossless = {"speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0}
    assert sglang.sampling_warning(spec, lossless, drawn) is None
    assert sglang.sampling_warning(spec, {**lossless, "speculative_accept_threshold_acc": 0.5}, None) is None  # greedy
    assert sglang.sampling_warning(None, None, drawn) is None  # not speculating: nothing to verify
    lossy = sglang.sampling_warning(spec, {**lossless, "speculative_accept_threshold_single": 0.7}, drawn)
    assert "speculative_accept_threshold_single=0.7" in lossy and "not 1.0" in lossy
    assert "unknown" in sglang.sampling_warning(spec, None, drawn)
    assert "ignores min_p" in sglang.sampling_warning(spec, lossless, {**drawn, "min_p": 0.1})


def _fetch(served, tmp_path, out, **drawn):
    from dflash_eval.testing import fixtures

    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 2)
    return fetch.fetch(
        {
            "dataset": "t",
            "prompts": str(prompts),
            "server": served["settings"],
            "tokenizer": str(served["target"]),
            "max_tokens": 10,
            "concurrency": 2,
            **drawn,
        },
        out,
    )


def test_sampled_fetch_end_to_end_keying_and_refetch(served, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from dflash_eval.demo.sampled import sampled_generate
    from dflash_eval.demo.server import spec_counters
    from dflash_eval.evaluate.drafter import load_drafter

    out = tmp_path / "c.jsonl"
    records = _fetch(served, tmp_path, out, **DRAWN)
    assert [r["id"] for r in records] == ["p0#s0", "p0#s1", "p1#s0", "p1#s1"]
    assert len({r["sampling"]["seed"] for r in records}) == 4
    target = AutoModelForCausalLM.from_pretrained(served["target"], dtype=torch.float32).eval()
    drafter = load_drafter(served["drafter"], reference=True).model.eval()
    eos = target.generation_config.eos_token_id
    for r in records:
        assert r["sampling"] == {
            "temperature": 0.7,
            "top_p": 0.95,
            "top_k": -1,
            "min_p": 0.0,
            "seed": sampling.record_seed(5, r["id"]),
        }
        assert "sampling_warning" not in r  # the demo server is lossless
        assert r["sampling_sent"] == {
            "top_p": 0.95,
            "seed": r["sampling"]["seed"],
            "top_k": -1,
            "min_p": 0.0,
            **OFF_PENALTIES,
        }  # what was sent, off values included
        assert {k: r["request"][k] for k in OFF_PENALTIES} == OFF_PENALTIES
        with torch.no_grad():
            completion, steps = sampled_generate(
                drafter, target, r["prompt_token_ids"], 10, [eos], BLOCK, r["sampling"]
            )
        assert r["completion_token_ids"] == completion, r["id"]
        assert r["spec"] == spec_counters(steps, len(completion), BLOCK)
    assert records[0]["completion_token_ids"] != records[1]["completion_token_ids"]  # two draws of one prompt

    with caplog.at_level(logging.INFO):
        again = _fetch(served, tmp_path, out, **{**DRAWN, "n": 3})  # a larger n fetches only the new draws
    assert "4 kept from an earlier run" in caplog.text and again[:2] + again[3:5] == records
    assert [r["id"] for r in again][2::3] == ["p0#s2", "p1#s2"]
    caplog.clear()
    changed = _fetch(served, tmp_path, out, **{**DRAWN, "top_p": 0.9})  # another top_p: every record refetched
    assert all(r["sampling"]["top_p"] == 0.9 and r["request"]["top_p"] == 0.9 for r in changed)
    assert [r["sampling"]["seed"] for r in changed] == [r["sampling"]["seed"] for r in records]
    with pytest.raises(Exception, match="applies no penalties"):  # the demo does not serve what it cannot compute
        _fetch(served, tmp_path, tmp_path / "p.jsonl", **{**DRAWN, "repetition_penalty": 1.1})
