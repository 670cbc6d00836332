"""Fetch against vLLM 0.34.0's protocol, end to end against the demo server's vLLM mode speculating for real with a
tiny DFlash drafter: exact ids in and out, the served sampling sent, the per-request detailed metrics recorded."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import torch

from dflash_eval.demo.server import sglang_steps
from dflash_eval.demo.vllm_mode import spec_metrics
from dflash_eval.fetch import stage as fetch
from dflash_eval.server.control import ServerController
from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.demo_server import BLOCK, tiny_drafter_dir


def launch(base, target, drafter, level: str, dev_mode: bool = True):
    port = fixtures.free_port()
    config = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": BLOCK - 1})
    env = f"VLLM_SERVER_DEV_MODE={1 if dev_mode else 0} "
    command = (
        f"{env}OMP_NUM_THREADS=1 exec {sys.executable} -m dflash_eval.cli demo-server --engine vllm "
        f"--model-path {target} --port {port} --speculative-config '{config}' "
        f"--per-request-spec-decode-metrics {level} --enable-sleep-mode"
    )
    settings = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "command": command,
        "health_timeout_s": 120.0,
        "stop_grace_s": 5.0,
        "log_dir": str(base / f"logs-{level}-{dev_mode}"),
    }
    controller = ServerController(settings)
    controller.ensure_up()
    return controller, settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    target = hs.build_tiny_target(base / "target")
    return {"base": base, "target": target, "drafter": tiny_drafter_dir(target, base / "drafter")}


@pytest.fixture(scope="module")
def served(tiny):
    controller, settings = launch(tiny["base"], tiny["target"], tiny["drafter"], "detailed")
    try:
        yield {**tiny, "settings": settings}
    finally:
        controller.stop_if_launched()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fetch_records_vllms_ids_and_detailed_metrics(served, endpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_eval.demo.reference import run_reference_loop
    from dflash_eval.evaluate.drafter import load_drafter

    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 3)
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
        tmp_path / "c.jsonl",
    )
    target = AutoModelForCausalLM.from_pretrained(served["target"], dtype=torch.float32).eval()
    drafter = load_drafter(served["drafter"]).model
    eos = target.generation_config.eos_token_id
    for record in records:
        assert record["completion_ids_source"] == "server"
        assert record["token_check"] == {"prompt_tokens_match": True, "completion_tokens_match": True}
        assert record["request"]["prompt_format"] == ("token_ids" if endpoint == "completions" else "messages")
        speculative = record["server"]["speculative"]
        assert speculative == {
            "engine": "vllm",
            "version": "0.34.0",
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": str(served["drafter"]),
            "speculative_num_draft_tokens": BLOCK,
            "num_speculative_tokens": BLOCK - 1,
            "draft_sample_method": "greedy",
            "rejection_sample_method": "standard",
            "per_request_spec_decode_metrics": "detailed",
        }
        prompt = record["prompt_token_ids"]
        _, output = run_reference_loop(drafter, target, prompt, 12, [eos], block_size=BLOCK)
        assert record["completion_token_ids"] == output[len(prompt) :]
        long_steps, _ = run_reference_loop(drafter, target, prompt, 12 + BLOCK, [eos], block_size=BLOCK)
        steps = sglang_steps(long_steps, len(record["completion_token_ids"]))
        spec = record["spec"]
        assert spec["engine"] == "vllm" and spec["num_spec_steps"] == len(steps)
        assert spec["per_step_accepted"] == [s - 1 for s in steps] and spec["per_step_drafted"] == [BLOCK - 1] * len(
            steps
        )
        assert spec["acceptance_histogram"] == [sum(1 for s in steps if s - 1 == j) for j in range(BLOCK)]
        # vLLM's mean acceptance length counts the bonus token: our tau, the prefill token not counted
        assert spec["mean_acceptance_length"] == pytest.approx(sum(steps) / len(steps))


def test_the_sampled_fields_are_all_sent(served, tmp_path):
    """At T > 0 every field that decides the distribution goes to vLLM explicitly (its chat defaults come from
    generation_config.json otherwise), and the record says so."""
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 1)
    records = fetch.fetch(
        {
            "dataset": "t",
            "prompts": str(prompts),
            "server": served["settings"],
            "tokenizer": str(served["target"]),
            "max_tokens": 8,
            "endpoint": "completions",
            "temperature": 0.7,
            "n": 2,
            "top_p": 0.9,
            "top_k": 20,
            "sampling_seed": 5,
            "concurrency": 1,
        },
        tmp_path / "c.jsonl",
    )
    for record in records:
        assert set(record["sampling_sent"]) >= {
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        }
        assert record["spec"]["num_spec_steps"] == len(record["spec"]["per_step_accepted"])
        assert "sampling_warning" not in record  # greedy drafts, standard rejection: exact per request


def test_without_detailed_metrics_it_still_fetches_and_says_why(tiny, tmp_path, caplog):
    controller, settings = launch(tiny["base"], tiny["target"], tiny["drafter"], "summary")
    try:
        prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 2)
        records = fetch.fetch(
            {
                "dataset": "t",
                "prompts": str(prompts),
                "server": settings,
                "tokenizer": str(tiny["target"]),
                "max_tokens": 8,
                "concurrency": 1,
            },
            tmp_path / "c.jsonl",
        )
    finally:
        controller.stop_if_launched()
    assert all(r["spec"]["per_step_accepted"] is None and r["spec"]["num_spec_steps"] for r in records)
    why = records[0]["spec_why"]
    assert "summary" in why and "detailed" in why and why in caplog.text


def test_without_dev_mode_the_settings_are_unknown_and_named(tiny, tmp_path, caplog):
    controller, settings = launch(tiny["base"], tiny["target"], tiny["drafter"], "detailed", dev_mode=False)
    try:
        info = fetch.server_identity(settings["base_url"], None, str(tiny["target"]))
        status = urllib.request.urlopen(settings["base_url"] + "/version").status
    finally:
        controller.stop_if_launched()
    assert info.engine == "vllm" and info.token_ids and status == 200
    assert (
        info.speculative["speculative_algorithm"] is None
        and "VLLM_SERVER_DEV_MODE=1" in info.speculative["unknown_why"]
    )


def test_server_engine_setting_refuses_the_wrong_engine(served):
    from dflash_eval.fetch.retry import FetchError

    with pytest.raises(FetchError, match="server.engine is sglang"):
        fetch.server_identity(served["settings"]["base_url"], None, str(served["target"]), engine="sglang")
    assert (
        fetch.server_identity(served["settings"]["base_url"], None, str(served["target"]), engine="vllm").engine
        == "vllm"
    )


def test_spec_metrics_is_to_dict_by_hand():
    out = spec_metrics([3, 1, 4], 3, detailed=True)
    assert out == {
        "mean_acceptance_length": 1 + 5 / 3,
        "draft_acceptance_rate": 5 / 9,
        "acceptance_histogram": [1, 0, 1, 1],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 5,
        "num_draft_tokens": 9,
        "num_spec_tokens": 3,
        "per_step_accepted": [2, 0, 3],
        "per_step_drafted": [3, 3, 3],
    }
    assert "per_step_accepted" not in spec_metrics([3], 3, detailed=False)


def _call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    import urllib.error

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_the_demo_sleeps_and_wakes_as_vllm_and_the_release_kind_drives_it(served):
    from dflash_eval.server.control import server_paused

    base = served["settings"]["base_url"]
    assert _call(base + "/get_model_info")[0] == 404  # not SGLang
    assert _call(base + "/sleep?level=1", "POST", {}) == (200, {"status": "sleeping", "level": 1})
    assert _call(base + "/is_sleeping") == (200, {"is_sleeping": True})
    assert _call(base + "/health")[0] == 200  # vLLM's engine stays healthy asleep
    assert _call(base + "/v1/completions", "POST", {"prompt": [1, 2], "max_tokens": 2})[0] == 503
    assert _call(base + "/wake_up", "POST", {}) == (200, {"status": "awake", "tags": None})
    assert _call(base + "/is_sleeping") == (200, {"is_sleeping": False})
    status, body = _call(base + "/v1/completions", "POST", {"prompt": [1, 2], "max_tokens": 2, "return_ids": True})
    assert status == 400 and "return_ids" in body["error"]["message"]  # not a vLLM field: loud here
    release = {
        "kind": "release",
        "engine": "auto",
        "base_url": base,
        "log_dir": str(served["base"] / "release-logs"),
        "release_min_drop_gib": 0,
    }
    with server_paused(release):
        assert _call(base + "/is_sleeping") == (200, {"is_sleeping": True})
    assert _call(base + "/is_sleeping") == (200, {"is_sleeping": False})
