"""Fetch against SGLang 0.5.23's protocol: field names checked against SGLang's source, and the stage end to end
against the demo server (dflash_eval.demo.server) speculating for real with a tiny DFlash drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_eval.demo.server import sglang_steps, spec_counters
from dflash_eval.fetch import sglang
from dflash_eval.fetch import stage as fetch
from dflash_eval.report import online as online_panel
from dflash_eval.sglang_protocol import (
    PROTOCOL_FIELDS,
    SERVER_INFO,
    unknown_fields,
    wheel_fields,
)
from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.demo_server import BLOCK, tiny_drafter_dir


def test_field_names_equal_sglang_0_5_23_source(sglang_srt):
    """The snapshot the demo server and these tests use is what SGLang 0.5.23's source defines."""
    assert wheel_fields(sglang_srt) == PROTOCOL_FIELDS


def test_fetch_asks_and_reads_only_fields_sglang_defines():
    for endpoint, model in (("completions", "CompletionRequest"), ("chat", "ChatCompletionRequest")):
        assert set(sglang.request_flags(endpoint)) <= set(PROTOCOL_FIELDS[model]), endpoint
        assert {"return_token_ids", "return_spec_tokens_details"} <= set(sglang.request_flags(endpoint))
    assert "token_ids" in PROTOCOL_FIELDS["CompletionResponseChoice"]
    assert "response_token_ids" in PROTOCOL_FIELDS["ChatCompletionResponseChoice"]
    assert "token_ids" not in PROTOCOL_FIELDS["ChatCompletionResponseChoice"]  # what fetch used to read on chat
    assert "spec_tokens_details" in PROTOCOL_FIELDS["SglExt"] and "sglext" in PROTOCOL_FIELDS["CompletionResponse"]
    assert set(sglang.SPEC_COUNTERS) <= set(PROTOCOL_FIELDS["SpecTokensDetails"])
    # the engine's timing fetch records: keys SGLang writes into meta_info (renaming one fails here)
    assert set(sglang.TIMING_FIELDS) <= set(PROTOCOL_FIELDS["MetaInfo"])
    assert {"e2e_latency", "first_token_latency", "spec_verify_ct", "completion_tokens"} <= set(
        PROTOCOL_FIELDS["MetaInfo"]
    )
    assert "return_meta_info" in PROTOCOL_FIELDS["ChatCompletionRequest"]
    assert "return_meta_info" not in PROTOCOL_FIELDS["CompletionRequest"]  # so fetch cannot time /v1/completions
    assert "meta_info" not in PROTOCOL_FIELDS["CompletionResponseChoice"]


def test_counters_are_sglangs_definitions_by_hand():
    """Steps 3, 1, 4 (tokens per verification) after the prefill token: 9 completion tokens."""
    assert spec_counters([3, 1, 4], 9, block_size=4) == {
        "spec_accept_rate": 5 / 9,
        "spec_accept_length": 3.0,
        "spec_num_correct_drafts": 5,
        "spec_num_proposed_drafts": 9,
        "spec_verify_ct": 3,
        "spec_correct_drafts_histogram": [1, 0, 1, 1],
    }
    assert spec_counters([], 1, block_size=4) is None  # stopped at the prefill token: SGLang reports none


# ----- end to end -----


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fetch_records_the_servers_ids_and_counters_on_both_endpoints(served, endpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_eval.demo.reference import run_reference_loop
    from dflash_eval.evaluate.drafter import load_drafter

    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "c.jsonl"
    records = fetch.fetch(
        {
            "dataset": "t",
            "prompts": str(prompts),
            "server": served["settings"],
            "tokenizer": str(served["target"]),
            "max_tokens": 12,
            "endpoint": endpoint,
            "concurrency": 2,
        },
        out,
    )
    target = AutoModelForCausalLM.from_pretrained(served["target"], dtype=torch.float32).eval()
    drafter = load_drafter(served["drafter"]).model
    eos = target.generation_config.eos_token_id
    for record in records:
        assert record["completion_ids_source"] == "server", record["id"]
        assert record["token_check"] == {"prompt_tokens_match": True, "completion_tokens_match": True}
        assert record["server"]["speculative"] == {
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": str(served["drafter"]),
            "speculative_num_draft_tokens": BLOCK,
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 1,
            "version": "0.5.23",
        }
        prompt = record["prompt_token_ids"]
        _, output = run_reference_loop(drafter, target, prompt, 12, [eos], block_size=BLOCK)
        assert record["completion_token_ids"] == output[len(prompt) :]
        long_steps, long_output = run_reference_loop(drafter, target, prompt, 12 + BLOCK, [eos], block_size=BLOCK)
        steps = sglang_steps(long_steps, len(record["completion_token_ids"]))  # SGLang's full-block tail
        assert record["spec"] == spec_counters(steps, len(record["completion_token_ids"]), BLOCK)
        assert record["spec"]["spec_verify_ct"] == len(steps)
        assert record["spec"]["spec_accept_length"] * len(steps) == pytest.approx(len(record["completion_token_ids"]))
        # the engine's timing: meta_info's e2e_latency on chat only (0.5.23 has no meta_info on completions); the
        # server runs without --enable-metrics, so no first_token_latency: absent, never 0
        engine = record["engine"]
        assert engine["spec_verify_ct"] == len(steps) and engine["completion_tokens"] == len(
            record["completion_token_ids"]
        )
        if endpoint == "chat":
            assert engine["meta_info"] is True and set(engine) == {
                "meta_info",
                "e2e_latency",
                "spec_verify_ct",
                "completion_tokens",
            }
            assert 0 < engine["e2e_latency"] <= record["client_timing"]["wall_s"]
        else:
            assert engine == {
                "meta_info": False,
                "spec_verify_ct": len(steps),
                "completion_tokens": len(record["completion_token_ids"]),
            }


def test_the_server_refuses_fields_sglang_does_not_define(served):
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "return_tokens_ids": True}).encode()
    request = urllib.request.Request(
        served["settings"]["base_url"] + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert "return_tokens_ids" in error.value.read().decode()


def test_native_generate_answers_output_ids_and_meta_info(served):
    import urllib.request

    body = json.dumps({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).encode()
    request = urllib.request.Request(
        served["settings"]["base_url"] + "/generate", data=body, headers={"Content-Type": "application/json"}
    )
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert set(answer) == {"text", "output_ids", "meta_info"}
    meta = answer["meta_info"]
    assert meta["completion_tokens"] == len(answer["output_ids"]) and meta["finish_reason"]["type"] in (
        "stop",
        "length",
    )
    if "spec_verify_ct" in meta:
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])


def _resolutions(source: Path, function: str) -> dict[str, list[str]]:
    """Each keyword of the declare_resolution calls in `function` of an SGLang source file, with its value's source."""
    import ast

    tree = ast.parse(source.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    out: dict[str, list[str]] = {}
    calls = [
        c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "declare_resolution"
    ]
    for call in sorted(calls, key=lambda c: c.lineno):  # in source order
        for keyword in call.keywords:
            out.setdefault(keyword.arg, []).append(ast.unparse(keyword.value))
    return out


def test_the_demo_servers_speculative_resolution_is_0_5_23s(sglang_srt):
    """What the demo server's /get_server_info reports for DFLASH (upper-cased algorithm, num_steps and
    eagle_topk 1) is what 0.5.23's arg hooks resolve (arg_groups/speculative_hook.py)."""
    hook = sglang_srt / "arg_groups/speculative_hook.py"
    # upper-cased first; the alias pass after it renames only NEXTN/EAGLE (_resolve_speculative_algorithm_alias)
    assert (
        _resolutions(hook, "handle_speculative_decoding")["speculative_algorithm"][0]
        == "cfg.speculative_algorithm.upper()"
    )
    dflash = _resolutions(hook, "_handle_dflash")
    assert set(dflash["speculative_num_steps"]) == {"1"} and set(dflash["speculative_eagle_topk"]) == {"1"}


def test_another_sglang_version_is_a_warning_naming_both(caplog):
    sglang.check_version("0.5.23", "http://x")
    assert not caplog.records
    sglang.check_version("0.6.0", "http://x")
    assert "SGLang 0.6.0" in caplog.text and "SGLang 0.5.23 only (docs/sglang_protocol.md)" in caplog.text


# What each name that holds a server answer in fetch holds: the SGLang models whose fields may be read from it.
ANSWERS = {
    "resp": ("CompletionResponse", "ChatCompletionResponse"),
    "response": ("CompletionResponse", "ChatCompletionResponse"),
    "choice": ("CompletionResponseChoice", "ChatCompletionResponseChoice"),
    "message": ("ChatMessage",),
    "usage": ("UsageInfo",),
    "details": ("SpecTokensDetails",),
    "meta": ("ModelInfo",),
    "m": ("ModelCard",),
    "info": SERVER_INFO,
    "models": ("ModelList",),
    "sglext": ("SglExt",),
    "meta_info": ("MetaInfo",),
}


def fields_read(path: Path) -> dict[str, set[str]]:
    """Per answer name of ANSWERS, the string keys fetch reads from it: `name["key"]`, `name.get("key")`, and
    `(name.get("key") or {})` chains (the key read from the inner answer is attributed to the key's model)."""
    import ast

    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Constant)
        ):
            name, key = node.value.id, node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            name, key = node.func.value.id, node.args[0].value
        else:
            continue
        if name in ANSWERS and isinstance(key, str):
            out.setdefault(name, set()).add(key)
    return out


def test_every_response_field_fetch_reads_is_in_the_snapshot():
    """Renaming an SGLang field fetch reads (or misspelling it) fails here, on both endpoints and the probes."""
    import dflash_eval.fetch.stage

    read: dict[str, set[str]] = {}
    for module in (sglang, dflash_eval.fetch.stage):
        for name, keys in fields_read(Path(module.__file__)).items():
            read.setdefault(name, set()).update(keys)
    read.setdefault("info", set()).update(sglang.SPEC_SETTINGS, {"version"})
    read.setdefault("details", set()).update(sglang.SPEC_COUNTERS)
    read.setdefault("choice", set()).update({"token_ids", "response_token_ids"})  # completion_token_ids' loop
    for name, keys in read.items():
        assert not unknown_fields(dict.fromkeys(keys), *ANSWERS[name]), name
    # not vacuous: the scan finds what fetch is known to read
    assert {"choices", "usage", "sglext"} <= read["resp"] | read["response"] and {
        "message",
        "prompt_token_ids",
        "matched_stop",
    } <= read["choice"]
    assert {"model_path", "weight_version"} <= read["meta"] and "id" in read["m"]


def test_the_snapshot_has_what_fetch_needs():
    """The other direction: the fields fetch depends on are SGLang's (a snapshot losing one fails here)."""
    assert set(sglang.SPEC_SETTINGS) <= {f for model in SERVER_INFO for f in PROTOCOL_FIELDS[model]}
    assert "version" in PROTOCOL_FIELDS["ServerInfo"] and "api_key" in PROTOCOL_FIELDS["Serving"]


def sglang_tail_counters(
    steps_long: list[int], output_long: list[int], prompt_len: int, max_tokens: int, block_size: int
) -> tuple[dict, list[int]]:
    """report.online's counters of SGLang's run for `max_tokens`, from a full-block run with budget to spare,
    cut as the demo server cuts it (sglang_steps), and the completion."""
    completion = output_long[prompt_len:][:max_tokens]
    taken = sglang_steps(steps_long, len(completion))
    return {
        "verify_ct": len(taken),
        "completion_tokens": len(completion),
        "correct_drafts": sum(taken) - len(taken),
        "histogram": online_panel.drafts_histogram(taken),
        "accept_length": len(completion) / max(1, len(taken)),
        "block_size": block_size,
        "draft_model": None,
        "max_tokens": max_tokens,
    }, completion


def test_sglang_steps_by_hand():
    # steps 3, 4, 2, 4 of a run with budget to spare; 8 tokens wanted: 1 (prefill) + 3 + 4 reaches 8 in two steps
    assert sglang_steps([3, 4, 2, 4], 8) == [3, 4]
    assert sglang_steps([3, 4, 2, 4], 9) == [3, 4, 2]  # 8 < 9: a third step, counted whole though 1 token is kept
    assert sglang_steps([3, 4], 1) == []  # stopped at the prefill token


def test_the_max_tokens_tail_full_blocks_against_shortened_ones(tmp_path, record_property):
    """SGLang verifies full blocks and cuts at max_tokens; the reference loop (and evaluate) shortens the last
    blocks. Emulated on the tiny target and drafter: the panel must judge every request equal, and this
    measures how often the step counts differ."""
    from transformers import AutoModelForCausalLM

    from dflash_eval.demo.reference import run_reference_loop
    from dflash_eval.evaluate.drafter import load_drafter

    target_dir = hs.build_tiny_target(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_drafter(tiny_drafter_dir(target_dir, tmp_path / "drafter")).model
    stops = [target.generation_config.eos_token_id]
    generator = torch.Generator().manual_seed(0)
    judged = differ = shortened = 0
    for _ in range(6):
        prompt = torch.randint(3, target.config.vocab_size, (6,), generator=generator).tolist()
        steps_long, output_long = run_reference_loop(drafter, target, prompt, 16 + BLOCK, stops, block_size=BLOCK)
        for max_tokens in range(5, 17):
            steps, output = run_reference_loop(drafter, target, prompt, max_tokens, stops, block_size=BLOCK)
            counters, completion = sglang_tail_counters(steps_long, output_long, len(prompt), max_tokens, BLOCK)
            if not steps or not counters["verify_ct"]:
                continue  # stopped at the prefill token: no counters either side
            assert output[len(prompt) :] == completion  # greedy: the same tokens, only the steps may differ
            result = online_panel.compare_request(counters, steps, BLOCK)
            assert result["equal"], (prompt, max_tokens, steps, counters)
            judged += 1
            shortened += result["tail_shortened_from_step"] is not None
            differ += counters["verify_ct"] != len(steps)
    record_property("tail", {"requests": judged, "tail_shortened": shortened, "step_count_differs": differ})
    print(f"\ntail: {judged} requests, {shortened} with a shortened tail, {differ} with another step count")
    assert judged > 20 and shortened > 0
