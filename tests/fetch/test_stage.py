"""Fetch: prompt loading, and the stage end to end against a real `transformers serve` of a tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_eval import cli
from dflash_eval.config import stage_settings
from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.prompts import PromptFileError, load_prompts, select_subset
from dflash_eval.server.control import ServerController
from dflash_eval.server.http import http_request
from dflash_eval.testing import fixtures
from tests.support import servers as hs

MAX_TOKENS = 16
RECORD_FIELDS = {
    "id",
    "prompt_id",
    "turn",
    "dataset",
    "messages",
    "prompt_token_ids",
    "completion_token_ids",
    "text",
    "finish_reason",
    "usage",
    "request",
    "server",
    "completion_ids_source",
    "token_check",
    "spec",
    "engine",
    "client_timing",
    "sampling_sent",
}


# ----- prompt files -----


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"id": "b", "messages": [}', "invalid JSON"),
        ('{"id": "b"}', '"messages"'),
        ('{"id": "", "messages": [{"role": "user", "content": "x"}]}', '"id"'),
        ('{"id": "b", "messages": [{"content": "x"}]}', 'messages[0] needs "role"'),
        ('{"id": "a", "messages": [{"role": "user", "content": "x"}]}', "duplicate id 'a' (first at "),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_malformed_prompt_line_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "prompts.jsonl"
    good = '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}'
    path.write_text(f"{good}\n\n{line}\n{good.replace('a', 'c')}\n")
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert problem in str(err.value)


def test_fetch_cli_fails_on_malformed_prompts_before_touching_the_server(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"id": "a", "messages": []}\n')
    settings = {
        "dataset": "bad",
        "prompts": str(prompts),
        "tokenizer": "unused",
        "server": {"kind": "external", "start_command": "false", "stop_command": "false"},
    }
    log = tmp_path / "fetch.log"
    argv = ["--log", str(log), "fetch", "--settings", json.dumps(settings), "--out", str(tmp_path / "o.jsonl")]
    assert cli.main(argv) == 2
    assert f"{prompts}:1: " in log.read_text()
    assert not (tmp_path / "o.jsonl").exists()


def test_fetch_cli_takes_the_server_from_runtime_and_names_bad_runtime_json(tmp_path):
    """The workflow passes how fetch runs as --runtime beside --settings; it is merged in, and bad JSON is named."""
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"id": "a", "messages": []}\n')
    params = {"dataset": "bad", "prompts": str(prompts), "tokenizer": "unused"}
    runtime = {"server": {"kind": "external", "start_command": "false", "stop_command": "false"}, "concurrency": 2}
    log = tmp_path / "fetch.log"
    base = ["--log", str(log), "fetch", "--settings", json.dumps(params), "--out", str(tmp_path / "o.jsonl")]
    assert cli.main([*base, "--runtime", json.dumps(runtime)]) == 2
    assert f"{prompts}:1: " in log.read_text()  # got past the settings check: the server came from --runtime
    assert cli.main(base) == 2 and "missing ['server']" in log.read_text()
    assert cli.main([*base, "--runtime", "{concurrency: 2"]) == 2
    assert "--runtime is not valid JSON" in log.read_text()


def test_subset_is_deterministic_and_in_file_order(tmp_path):
    prompts = load_prompts(fixtures.write_prompts(tmp_path / "p.jsonl", 20))
    a = select_subset(prompts, 5, seed=1)
    assert a == select_subset(prompts, 5, seed=1)
    assert [int(p.id[1:]) for p in a] == sorted(int(p.id[1:]) for p in a)
    assert select_subset(prompts, None, 0) == prompts == select_subset(prompts, 50, 0)


def test_a_prompt_files_subset_and_digest_do_not_depend_on_its_order(tmp_path):
    """Issue 32: a reordered prompt file picked another subset and reran every evaluation."""
    from dflash_eval.fetch.prompts import order_free_digest

    prompts = load_prompts(fixtures.write_prompts(tmp_path / "p.jsonl", 20))
    shuffled = prompts[7:] + prompts[:7][::-1]
    picked = select_subset(prompts, 5, seed=1, by_id=True)
    assert {p.id for p in select_subset(shuffled, 5, seed=1, by_id=True)} == {p.id for p in picked}
    assert [p.id for p in select_subset(shuffled, 5, seed=1, by_id=True)] == [p.id for p in shuffled if p in picked]
    assert {p.id for p in select_subset(shuffled, 5, seed=1)} != {p.id for p in picked}, "a preset's rows: by position"
    assert order_free_digest(shuffled) == order_free_digest(prompts)
    edited = [prompts[0].__class__(prompts[0].id, [{"role": "user", "content": "other"}]), *prompts[1:]]
    assert order_free_digest(edited) != order_free_digest(prompts)


# ----- end to end against `transformers serve` -----


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    settings = hs.shared_transformers_server(tmp_path_factory.getbasetemp())
    yield settings
    ServerController(settings).stop_if_launched()


@pytest.fixture(scope="module")
def reference(tiny_server):
    """The tiny target's tokenizer and model, loaded here, to compute what the server should return."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model_dir = hs.shared_model_dir()
    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


def greedy(reference, prompt_ids: list[int]) -> list[int]:
    import torch

    tok, model = reference
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def fetch_settings(tmp_path: Path, server: dict, n: int, endpoint: str = "completions") -> dict:
    return {
        "dataset": "tiny",
        "prompts": str(fixtures.write_prompts(tmp_path / "prompts.jsonl", n)),
        "max_samples": None,
        "seed": 0,
        "server": server,
        "tokenizer": str(hs.shared_model_dir()),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "concurrency": 2,
        "timeout_s": 120.0,
        "retries": 2,
        "endpoint": endpoint,
        "chat_template_kwargs": {},
    }


def failure_logs(log: Path, server: dict) -> str:
    """The fetch log and the ends of the server's logs, for a failure's message (the GPU machine's full-suite run
    of 2026-12-03 saw exit code 2 here once, beside the GPU demo, and nothing more)."""
    parts = [f"--- {log} ---", log.read_text() if log.exists() else "(none)"]
    for path in sorted(Path(server["log_dir"]).glob("*")):
        if path.is_file():
            parts += [f"--- {path} (end) ---", path.read_text(errors="replace")[-3000:]]
    return "\n".join(parts)


def test_fetch_end_to_end(tmp_path, tiny_server, reference):
    settings = fetch_settings(tmp_path, tiny_server, 4)
    out = tmp_path / "completions" / "tiny.jsonl"
    log = tmp_path / "fetch.log"
    code = cli.main(["--log", str(log), "fetch", "--settings", json.dumps(settings), "--out", str(out)])
    assert code == 0, failure_logs(log, tiny_server)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3"]
    assert sorted(out.parent.iterdir()) == [  # no temp file left behind; the stamp beside the output
        out,
        out.with_name("tiny.jsonl.partial"),
        out.with_name("tiny.jsonl.stamp.json"),
    ]
    assert out.with_name("tiny.jsonl.partial").samefile(out)  # the records a rerun reuses: a link of the output
    assert '"records": 4' in log.read_text()

    tok, _ = reference
    eos = tok.eos_token_id
    for r in records:
        assert set(r) == RECORD_FIELDS
        ours = tok(
            tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        assert r["prompt_token_ids"] == ours
        assert r["usage"]["prompt_tokens"] == len(ours) and r["token_check"]["prompt_tokens_match"] is True
        assert r["completion_ids_source"] == "retokenized"
        assert r["server"]["model"] == str(hs.shared_model_dir()) and r["server"]["base_url"] == tiny_server["base_url"]
        assert r["request"]["endpoint"] == "completions" and r["request"]["temperature"] == 0.0
        assert r["spec"] is None
        # no meta_info from a plain OpenAI server: no engine timing, recorded as absent (not 0)
        assert r["engine"] == {"meta_info": False, "completion_tokens": r["usage"]["completion_tokens"]}
        assert r["client_timing"]["concurrency"] == 2 and r["client_timing"]["wall_s"] > 0
        expected = greedy(reference, ours)
        if r["finish_reason"] == "stop":
            assert expected[-1] == eos and len(expected) < MAX_TOKENS
        else:
            assert r["finish_reason"] == "length" and len(expected) == MAX_TOKENS
        # transformers serve counts the eos token in usage.completion_tokens, and its text drops it.
        assert r["usage"]["completion_tokens"] == len(expected)
        if expected[-1] == eos and r["finish_reason"] == "length":
            # eos as the very last allowed token is reported as "length": re-encoding cannot see it.
            assert r["completion_token_ids"] == expected[:-1]
            assert r["token_check"]["completion_tokens_match"] is False
        else:
            assert r["completion_token_ids"] == expected
            assert r["token_check"]["completion_tokens_match"] is True
    assert {r["finish_reason"] for r in records} == {"stop", "length"}  # both paths exercised


def test_fetch_chat_endpoint_matches_completions(tmp_path, tiny_server):
    by_endpoint = {}
    for endpoint in ("completions", "chat"):
        out = tmp_path / f"{endpoint}.jsonl"
        by_endpoint[endpoint] = fetch.fetch(fetch_settings(tmp_path, tiny_server, 2, endpoint), out)
    for a, b in zip(by_endpoint["completions"], by_endpoint["chat"]):
        assert b["request"]["endpoint"] == "chat" and b["request"]["prompt_format"] == "messages"
        for key in ("prompt_token_ids", "completion_token_ids", "text", "finish_reason", "usage", "token_check"):
            assert a[key] == b[key], key


def test_eos_as_the_last_allowed_token_is_reported_as_length(tmp_path, tiny_server, reference):
    """transformers serve 5.24 says "length" whenever max_tokens tokens came out, even if the last was eos;
    its text drops the eos, so the retokenized ids are one short and the token check flags the record."""
    tok, _ = reference
    for prompt in load_prompts(fixtures.write_prompts(tmp_path / "all.jsonl", 4)):
        text = tok.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        expected = greedy(reference, tok(text, add_special_tokens=False)["input_ids"])
        if expected[-1] == tok.eos_token_id:
            break
    else:
        pytest.fail("no prompt of the tiny target stops on eos")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"id": prompt.id, "messages": prompt.messages}) + "\n")
    settings = {**fetch_settings(tmp_path, tiny_server, 1), "prompts": str(one), "max_tokens": len(expected)}
    [record] = fetch.fetch(settings, tmp_path / "out.jsonl")
    assert record["finish_reason"] == "length" and record["usage"]["completion_tokens"] == len(expected)
    assert record["completion_token_ids"] == expected[:-1]
    assert record["token_check"]["completion_tokens_match"] is False


@pytest.mark.skipif(
    not hs.serve_lists_its_model(),
    reason=(
        "transformers serve before 5.24 (5.17 read and seen) lists only the hub cache's models at /v1/models, never "
        "the local model it serves, and answers HTTP 500 (huggingface_hub CacheNotFound) where there is no hub cache; "
        "the fetch tests then name the model (server.model)"
    ),
)
def test_transformers_serve_lists_the_model_that_fetch_reads(tiny_server):
    """Where the shared server's settings leave `model` to fetch, /v1/models lists exactly the served local model:
    the name the end-to-end test sees in every record came from the server."""
    assert tiny_server["model"] is None
    ServerController(tiny_server).ensure_up()
    status, body = http_request(tiny_server["base_url"] + "/v1/models", timeout=30.0)
    assert status == 200, body[:500]
    assert [m["id"] for m in json.loads(body)["data"]] == [str(hs.shared_model_dir())]


COUNTERS = {
    "spec_accept_length": 3.25,
    "spec_verify_ct": 4,
    "spec_num_correct_drafts": 8,
    "spec_num_proposed_drafts": 28,
    "spec_correct_drafts_histogram": [0, 1, 2, 1],
    "spec_accept_rate": 8 / 28,
}


@pytest.mark.parametrize("where", ["sglext", "sglext-list", "chat-meta_info", None])
def test_spec_counters_are_recorded_where_sglang_puts_them(where):
    """SGLang 0.5.23 answers the counters at the response level, `sglext.spec_tokens_details` (a list for n > 1),
    and a chat choice's `meta_info` holds the same keys; they go to `spec`; a server that reports none gives
    `spec: null`, never zeros. Chat ids come as `response_token_ids`."""
    chat = where == "chat-meta_info"
    choice = {"finish_reason": "length", "prompt_token_ids": [1, 2]}
    if chat:
        choice.update(message={"role": "assistant", "content": "ab"}, response_token_ids=[5, 6])
    else:
        choice.update(text="ab", token_ids=[5, 6])
    resp = {"choices": [choice], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    extra = {"spec_cap_length": 0.0, "e2e_latency": 0.1}
    if where == "sglext":
        resp["sglext"] = {"spec_tokens_details": {**COUNTERS, **extra}}
    elif where == "sglext-list":
        resp["sglext"] = {"spec_tokens_details": [{**COUNTERS, **extra}]}
    elif chat:
        choice["meta_info"] = {**COUNTERS, **extra, "id": "x"}
    settings = stage_settings(
        "fetch",
        {"dataset": "d", "prompts": "p", "server": {}, "tokenizer": "t", "endpoint": "chat" if chat else "completions"},
    )
    spec = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 8}
    info = fetch.ServerInfo("http://x", "m", "/models/m", "w1", sglang=True, speculative=spec)
    rendered = fetch.Rendered("a", "a", 1, [{"role": "user", "content": "x"}], "x", [1, 2])
    rec = fetch.build_record(resp, rendered, settings, info, tokenizer=None)
    assert rec["spec"] == (COUNTERS if where else None)
    assert rec["completion_token_ids"] == [5, 6] and rec["text"] == "ab"
    assert rec["server"] == {
        "base_url": "http://x",
        "model": "m",
        "model_path": "/models/m",
        "weight_version": "w1",
        "speculative": spec,
    }
    assert rec["completion_ids_source"] == "server" and rec["token_check"] == {
        "prompt_tokens_match": True,
        "completion_tokens_match": True,
    }
