"""The vLLM 0.34.0 field snapshot against the wheel's own source, both ways, and the facts fetch relies on."""

from __future__ import annotations

import ast
from pathlib import Path

from dflash_eval import vllm_protocol
from dflash_eval.fetch import vllm as fetch_vllm
from dflash_eval.server import engines


def test_snapshot_equals_the_wheel_both_ways(vllm_src: Path) -> None:
    """Every snapshot entry is in the wheel with exactly its names, and the wheel has no entry the snapshot lacks."""
    wheel = vllm_protocol.wheel_fields(vllm_src)
    assert set(wheel) == set(vllm_protocol.PROTOCOL_FIELDS)
    for name, fields in wheel.items():
        missing = sorted(set(vllm_protocol.PROTOCOL_FIELDS[name]) - set(fields))
        extra = sorted(set(fields) - set(vllm_protocol.PROTOCOL_FIELDS[name]))
        assert not missing and not extra, f"{name}: gone from the wheel {missing}, new in the wheel {extra}"


def test_the_version_is_the_wheels(vllm_src: Path) -> None:
    assert f"'{vllm_protocol.VERSION}'" in (vllm_src / "_version.py").read_text()


def test_the_spec_metrics_response_model_is_to_dict(vllm_src: Path) -> None:
    """What the scheduler's accumulator writes (to_dict) is exactly the response model's fields, so every key
    fetch reads is one the server sends."""
    fields = vllm_protocol.PROTOCOL_FIELDS
    assert fields["SpecDecodeMetricsDict"] == fields["SpeculativeDecodingMetrics"]
    assert set(fetch_vllm.SPEC_METRICS) <= set(fields["SpeculativeDecodingMetrics"])


def test_every_field_fetch_reads_or_sends_is_vllms() -> None:
    fields = vllm_protocol.PROTOCOL_FIELDS
    for endpoint, model in (("completions", "CompletionRequest"), ("chat", "ChatCompletionRequest")):
        assert not vllm_protocol.unknown_fields(fetch_vllm.request_flags(endpoint), model)
    assert (
        "token_ids" in fields["CompletionResponseChoice"] and "prompt_token_ids" in fields["CompletionResponseChoice"]
    )
    assert (
        "token_ids" in fields["ChatCompletionResponseChoice"] and "prompt_token_ids" in fields["ChatCompletionResponse"]
    )
    assert "metrics" in fields["CompletionResponse"] and "metrics" in fields["ChatCompletionResponse"]
    assert "speculative_decoding" in fields["PerRequestMetrics"]
    assert set(fetch_vllm.SPEC_CONFIG) <= set(fields["SpeculativeConfig"])
    assert "per_request_spec_decode_metrics" in fields["ObservabilityConfig"]
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "max_tokens",
    ):
        assert key in fields["CompletionRequest"] and key in fields["ChatCompletionRequest"], key
    assert "chat_template_kwargs" in fields["ChatCompletionRequest"]


def test_sleep_routes_and_levels(vllm_src: Path) -> None:
    """The release kind's calls exist, and the level it sends is in the route's bounds (Query(ge=0, le=2))."""
    fields = vllm_protocol.PROTOCOL_FIELDS
    for route in (engines.VLLM_SLEEP_ROUTE, engines.VLLM_WAKE_ROUTE, engines.VLLM_SLEEPING_ROUTE):
        assert route in fields["SleepRoutes"]
    assert "level" in fields["SleepParameters"]
    source = (vllm_src / "entrypoints/serve/dev/sleep/api_router.py").read_text()
    level = next(
        a
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "sleep"
        for a, d in zip(n.args.args[-len(n.args.defaults) :], n.args.defaults)
        if a.arg == "level"
    )
    assert "Query(ge=0, le=2)" in ast.unparse(level.annotation)
    assert 0 <= engines.VLLM_SLEEP_LEVEL <= 2
    # the sleep routes are registered only in dev mode (VLLM_SERVER_DEV_MODE), which fetch_vllm names
    routers = (vllm_src / "entrypoints/launchers/api_server/routers.py").read_text()
    assert "if envs.VLLM_SERVER_DEV_MODE:" in routers and "register_vllm_dev_api_routers(app)" in routers
    assert engines.VLLM_DEV_MODE_ENV == "VLLM_SERVER_DEV_MODE"


def test_accepted_counts_before_the_output_is_cut(vllm_src: Path) -> None:
    """The scheduler observes a step's accepted drafts before _update_request_with_output cuts at a stop token
    or max_tokens: the last step's count is raw (the online panel's tolerance on the last step)."""
    source = (vllm_src / "v1/core/sched/scheduler.py").read_text()
    observed = source.index("request.spec_decode_metrics.observe(")
    cut = source.index("self._update_request_with_output(", observed - 2000)
    assert observed < cut
    assert "num_accepted = max(len(generated_token_ids) - num_sampled, 0)" in source


def test_a_version_mismatch_warns(caplog) -> None:
    fetch_vllm.check_version("0.35.0", "http://x")
    assert "0.35.0" in caplog.text and vllm_protocol.VERSION in caplog.text
    caplog.clear()
    fetch_vllm.check_version(vllm_protocol.VERSION, "http://x")
    assert not caplog.text


def test_the_source_facts_the_release_kind_and_the_demo_rely_on(vllm_src: Path) -> None:
    """docs/vllm_protocol.md's sleep, block and key facts, read where the page says they are."""
    worker = (vllm_src / "v1/worker/gpu_worker.py").read_text()
    sleep = worker[worker.index("    def sleep(self, level: int = 1)") : worker.index("    def wake_up(")]
    assert "if level == 2" in sleep and "_discardable_parameters" in sleep  # only level 2 discards weights
    assert "Level 2 sleep discards draft model weights" in worker
    speculator = (vllm_src / "v1/worker/gpu/spec_decode/dflash/speculator.py").read_text()
    assert "self.num_query_per_req = 1 + self.num_speculative_steps" in speculator  # the block is K + 1
    basic = (vllm_src / "entrypoints/serve/instrumentator/basic.py").read_text()
    assert 'ver = {"version": VLLM_VERSION}' in basic
    auth = (vllm_src / "entrypoints/serve/middleware/authenticate.py").read_text()
    from dflash_eval.demo.vllm_mode import GUARDED_PREFIX

    assert f"GUARDED_PREFIX = {GUARDED_PREFIX!r}".replace("'", '"') in auth
    dflash = (vllm_src / "model_executor/models/qwen3_dflash.py").read_text()
    causal = dflash[dflash.index("def _dflash_layer_causal") : dflash.index("def dflash_has_any_non_causal")]
    order = [causal.index(key) for key in ('getattr(config, "is_causal"', '.get("causal")', '"layer_types"')]
    assert order == sorted(order)


def test_the_docs_vllm_recipe_uses_only_the_wheels_flags(vllm_src: Path) -> None:
    """Every flag of docs/server.md's vLLM command is one 0.34.0's parser defines, and its JSON is SpeculativeConfig's."""
    import json
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    block = doc.split("<!-- vllm-recipe -->", 1)[1].split("<!-- /vllm-recipe -->", 1)[0]
    words = shlex.split(block.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " "))
    assert words[:3] == ["VLLM_SERVER_DEV_MODE=1", "vllm", "serve"]
    engine_args = (vllm_src / "engine/arg_utils.py").read_text()
    frontend = (vllm_src / "entrypoints/common/cli_args.py").read_text()
    flags = [w for w in words if w.startswith("--")]
    assert flags == ["--port", "--speculative-config", "--per-request-spec-decode-metrics", "--enable-sleep-mode"]
    for flag in flags:
        assert f'"{flag}"' in engine_args or re.search(rf"^    {flag[2:].replace('-', '_')}: ", frontend, re.M), flag
    config = json.loads(words[words.index("--speculative-config") + 1])
    assert not vllm_protocol.unknown_fields(config, "SpeculativeConfig") and config["method"] == "dflash"
    level = words[words.index("--per-request-spec-decode-metrics") + 1]
    assert level in vllm_protocol.PROTOCOL_FIELDS["PerRequestSpecDecodeMetrics"]
    assert (vllm_src / "entrypoints/cli/serve.py").is_file()  # `vllm serve`
