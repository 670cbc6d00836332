"""The demo server's vLLM 0.34.0 mode (`dflash-eval demo-server --engine vllm`): the same engine, answering as
vLLM does (docs/vllm_protocol.md), every body checked against vllm_protocol's snapshot.

vLLM's launch flags for what the demo serves: `--speculative-config '{"method": "dflash", "model": DIR,
"num_speculative_tokens": K}'` (the block is K + 1), `--per-request-spec-decode-metrics none|summary|detailed`,
`--enable-sleep-mode`; VLLM_SERVER_DEV_MODE=1 in the environment registers `/server_info` and the sleep routes
(`/sleep?level=`, `/wake_up`, `/is_sleeping`), as vLLM's routers do. With `--api-key` only paths under /v1 (and
vLLM's other guarded prefixes) want the key (serve/middleware/authenticate.py).

The per-request metrics are RequestSpecDecodeMetrics.to_dict's from the loop's steps, cut as vLLM's scheduler
verifies (full blocks; the output cut at max_tokens afterwards): per step, K drafted and step - 1 accepted. One
difference remains, stated as in the SGLang mode: at a stop token the loop cuts the last step, where vLLM counts
that step's accepted drafts raw (observed before the stop check), so the last entry may be lower than vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from dflash_eval.demo.request_sampling import penalties_set, sampling_request
from dflash_eval.server.engines import VLLM_DEV_MODE_ENV as DEV_MODE_ENV
from dflash_eval.vllm_protocol import VERSION, check_fields, unknown_fields

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # serve/middleware/authenticate.py


def resolve_args(args: argparse.Namespace) -> None:
    """Fill the engine's speculative arguments from vLLM's `--speculative-config` JSON (method dflash only)."""
    if not args.speculative_config:
        args.vllm_speculative = {
            "method": "dflash",
            "model": args.speculative_draft_model_path,
            "draft_sample_method": "greedy",
            "rejection_sample_method": "standard",
        }
        return
    config = json.loads(args.speculative_config)
    unknown = unknown_fields(config, "SpeculativeConfig")
    if unknown:
        raise SystemExit(f"--speculative-config: {unknown} are not vLLM {VERSION}'s SpeculativeConfig fields")
    if str(config.get("method")).lower() != "dflash" or not config.get("model"):
        raise SystemExit("the demo serves --speculative-config with method dflash and a model only")
    args.speculative_algorithm = "DFLASH"
    args.speculative_draft_model_path = config["model"]
    tokens = config.get("num_speculative_tokens")
    args.speculative_num_draft_tokens = None if tokens is None else int(tokens) + 1
    args.vllm_speculative = {
        "method": "dflash",
        "model": config["model"],
        "draft_sample_method": config.get("draft_sample_method", "greedy"),
        "rejection_sample_method": config.get("rejection_sample_method", "standard"),
    }
    if (
        args.vllm_speculative["rejection_sample_method"] != "standard"
        or args.vllm_speculative["draft_sample_method"] != "greedy"
    ):
        raise SystemExit("the demo verifies with greedy drafts and standard rejection only")


def authorized(path: str, header: str | None, key: str | None) -> bool:
    """vLLM's key check: only the guarded prefixes want `Authorization: Bearer KEY`."""
    if key is None or not path.startswith(GUARDED_PREFIX):
        return True
    scheme, _, token = (header or "").partition(" ")
    import hmac

    return scheme.lower() == "bearer" and hmac.compare_digest(token, key)


def spec_metrics(steps: list[int], num_spec_tokens: int, detailed: bool) -> dict[str, Any]:
    """RequestSpecDecodeMetrics.to_dict of a request whose verify steps produced `steps` tokens each."""
    histogram = [0] * (num_spec_tokens + 1)
    for step in steps:
        histogram[step - 1] += 1
    accepted = sum(step - 1 for step in steps)
    drafted = num_spec_tokens * len(steps)
    out: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": num_spec_tokens,
    }
    if detailed and steps:  # to_dict adds the arrays only when populated
        out.update(per_step_accepted=[step - 1 for step in steps], per_step_drafted=[num_spec_tokens] * len(steps))
    return check_fields(out, "SpecDecodeMetricsDict")


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields in the engine's terms: vLLM's top_k 0 (its default) is "off", -1 there too."""
    params = dict(body)
    if params.get("top_k") in (None, 0):
        params["top_k"] = -1
    return params


class VllmRoutes:
    """The routes of vLLM 0.34.0 the demo answers, over the SGLang-mode handler's engine."""

    def __init__(self, handler: Any) -> None:
        self.handler, self.engine = handler, handler.engine
        self.args = self.engine.args

    def dev_mode(self) -> bool:
        return os.environ.get(DEV_MODE_ENV, "0") not in ("", "0")

    def get(self, path: str, query: str) -> tuple[int, dict[str, Any]]:
        name = self.args.served_model_name or self.args.model_path
        if path == "/health":
            return 200, {}  # vLLM's engine stays healthy while asleep (instrumentator/health.py)
        if path == "/version":
            return 200, {"version": VERSION}
        if path == "/v1/models":
            card = check_fields(
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": self.args.model_path,
                    "parent": None,
                    "max_model_len": 4096,
                    "permission": [],
                },
                "ModelCard",
            )
            return 200, check_fields({"object": "list", "data": [card]}, "ModelList")
        if self.dev_mode() and path == "/server_info":
            return 200, {"vllm_config": self.vllm_config(), "vllm_env": {DEV_MODE_ENV: True}, "system_env": {}}
        if self.dev_mode() and path == "/is_sleeping":
            return 200, {"is_sleeping": self.engine.released}
        return 404, {"detail": "Not Found"}

    def vllm_config(self) -> dict[str, Any]:
        """The parts of `/server_info?config_format=json`'s vllm_config that dflash-eval reads."""
        speculative = None
        if self.engine.drafter is not None:
            speculative = check_fields(
                {**self.args.vllm_speculative, "num_speculative_tokens": self.engine.block_size - 1},
                "SpeculativeConfig",
            )
        return check_fields(
            {
                "model_config": check_fields(
                    {"model": self.args.model_path, "enable_sleep_mode": bool(self.args.enable_sleep_mode)},
                    "ModelConfig",
                ),
                "speculative_config": speculative,
                "observability_config": check_fields(
                    {"per_request_spec_decode_metrics": self.args.per_request_spec_decode_metrics},
                    "ObservabilityConfig",
                ),
            },
            "VllmConfig",
        )

    def post(self, path: str, query: str, body: dict[str, Any], received: float) -> tuple[int, dict[str, Any]]:
        from urllib.parse import parse_qs

        if self.dev_mode() and path == "/sleep":
            level = int((parse_qs(query).get("level") or ["1"])[0])
            if not self.args.enable_sleep_mode or not 0 <= level <= 2:
                return 400, {"error": f"sleep level {level} (0-2) needs --enable-sleep-mode"}
            self.engine.released = True
            self.engine.sleep_level = level
            return 200, {"status": "sleeping", "level": level}
        if self.dev_mode() and path == "/wake_up":
            self.engine.released = False
            return 200, {"status": "awake", "tags": None}
        if path in ("/v1/completions", "/v1/chat/completions"):
            if self.engine.released:
                return 503, {"error": "the engine is asleep"}
            return self.openai(body, chat=path.endswith("chat/completions"), received=received)
        return 404, {"detail": "Not Found"}

    def openai(self, body: dict[str, Any], chat: bool, received: float) -> tuple[int, dict[str, Any]]:
        model = "ChatCompletionRequest" if chat else "CompletionRequest"
        unknown = unknown_fields(body, model)
        penalized = penalties_set(body)
        if unknown or penalized:
            why = (
                f"fields {unknown} are not in vLLM {VERSION}'s {model}"
                if unknown
                else f"{penalized}: the demo server applies no penalties, so it refuses them"
            )
            return 400, {"error": {"message": why, "type": "BadRequestError", "code": 400}}
        engine = self.engine
        if chat:
            text = engine.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=False, **(body.get("chat_template_kwargs") or {})
            )
            prompt = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 128)
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                prompt = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            max_tokens = int(body.get("max_tokens") or 16)
        prompt = [int(t) for t in prompt]
        completion, _, _ = engine.timed_generate(
            prompt, max_tokens, sampling_request(sampling(body), body.get("seed")), received
        )
        stopped = bool(completion) and completion[-1] in engine.stops
        primary_eos = engine.tokenizer.eos_token_id
        stop_reason = completion[-1] if stopped and completion[-1] != primary_eos else None
        text = engine.tokenizer.decode(completion, skip_special_tokens=True)
        ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop" if stopped else "length",
            "stop_reason": stop_reason,
        }
        response: dict[str, Any] = {
            "id": "cmpl-0",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.args.model_path,
        }
        if chat:
            choice["message"] = check_fields({"role": "assistant", "content": text, "reasoning": None}, "ChatMessage")
            choice["token_ids"] = completion if ids else None
            response["prompt_token_ids"] = prompt if ids else None
        else:
            choice.update(text=text, token_ids=completion if ids else None, prompt_token_ids=prompt if ids else None)
        response["choices"] = [
            check_fields(choice, "ChatCompletionResponseChoice" if chat else "CompletionResponseChoice")
        ]
        response["usage"] = check_fields(
            {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(completion),
                "completion_tokens": len(completion),
            },
            "UsageInfo",
        )
        level = self.args.per_request_spec_decode_metrics
        response["metrics"] = None
        if engine.drafter is not None and level != "none":
            response["metrics"] = check_fields(
                {"speculative_decoding": spec_metrics(engine.last_steps, engine.block_size - 1, level == "detailed")},
                "PerRequestMetrics",
            )
        return 200, check_fields(response, "ChatCompletionResponse" if chat else "CompletionResponse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's own launch flags for the demo's vLLM mode."""
    parser.add_argument(
        "--engine",
        choices=("sglang", "vllm"),
        default="sglang",
        help="answer as SGLang 0.5.23 (default) or as vLLM 0.34.0 does",
    )
    parser.add_argument("--speculative-config", help="vLLM's: JSON with method dflash, model, num_speculative_tokens")
    parser.add_argument(
        "--per-request-spec-decode-metrics",
        choices=("none", "summary", "detailed"),
        default="none",
        help="vLLM's: metrics.speculative_decoding per response (detailed: the per-step arrays)",
    )
    parser.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="vLLM's: /sleep and /wake_up (routes registered with VLLM_SERVER_DEV_MODE=1)",
    )
