"""A fetch rerun whose kept records all answer its request reuses them without the server: a code change alone
neither wakes nor waits for nor asks it. The real fetch stage against the fake OpenAI server process
(dflash_eval/testing/fake_openai_server.py) for the first run; the rerun's server is gone."""

from __future__ import annotations

import json

import pytest

from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.store import partial_path
from dflash_eval.provenance import identity
from dflash_eval.provenance.stamps import read_stamp, side_stamp_path
from dflash_eval.testing import fixtures
from tests.support.fake_fetch import fake, settings


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    fixtures.build_tokenizer(out)
    return out


def _no_server(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the server was asked")

    monkeypatch.setattr(fetch, "ServerController", refuse)
    monkeypatch.setattr(fetch, "server_identity", refuse)


def test_a_rerun_with_every_record_kept_needs_no_server_and_a_settings_change_does(
    tmp_path, tokenizer_dir, monkeypatch, caplog
):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "m", "system": "Be brief.", "turns": ["Question 0: first?", "And then?"]})
        + "\n"
        + json.dumps({"id": "s", "messages": [{"role": "user", "content": "Question 1: single"}]})
        + "\n"
    )
    out = tmp_path / "o.jsonl"
    with fake(tokenizer_dir, None, "--sglang", model=f"/models/{tokenizer_dir.name}") as url:
        first = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    made = out.read_bytes()
    stamp = json.loads(side_stamp_path(out).read_text())  # beside the file: the records keep their format
    assert stamp == {"code_identity": identity.stage_identity("fetch", stamp["engine"]), "engine": stamp["engine"]}
    assert read_stamp(out) == stamp["code_identity"] and "code_identity" not in first[0]
    side_stamp_path(out).unlink()
    out.unlink()  # what Snakemake does before it reruns the job (after a fetch code change, say)

    _no_server(monkeypatch)  # and the server is gone: stopped, or held down by another run's extraction
    with caplog.at_level("INFO"):
        again = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    assert again == first and out.read_bytes() == made
    assert partial_path(out).samefile(out)
    assert read_stamp(out) == stamp["code_identity"], "a rerun that reused every record stamps the file too"
    assert "all 3 records reused without the server" in caplog.text
    assert f"model path /models/{tokenizer_dir.name}, weight version w1" in caplog.text

    out.unlink()  # another max_tokens: the kept records answer another request, so the server is needed
    caplog.clear()
    with caplog.at_level("INFO"), pytest.raises(AssertionError, match="the server was asked"):
        fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts, max_tokens=4), out)
    assert "the kept records answer other settings or another model; asking the server" in caplog.text

    caplog.clear()  # another served model named in the settings: the server is needed too
    named = settings(tmp_path, url, tokenizer_dir, prompts)
    named["server"]["model"] = "another"
    with caplog.at_level("INFO"), pytest.raises(AssertionError, match="the server was asked"):
        fetch.fetch(named, out)

    caplog.clear()  # a prompt added: one record is missing
    prompts.write_text(
        prompts.read_text()
        + json.dumps({"id": "n", "messages": [{"role": "user", "content": "Question 2: new"}]})
        + "\n"
    )
    with caplog.at_level("INFO"), pytest.raises(AssertionError, match="the server was asked"):
        fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    assert "1 of 4 records are not kept; asking the server" in caplog.text
