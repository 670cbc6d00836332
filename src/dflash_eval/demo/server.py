"""A small real server that speaks SGLang 0.5.23's HTTP protocol, and speculates for real with a DFlash drafter.

Run: `dflash-eval demo-server --model-path DIR --port P
[--speculative-algorithm DFLASH --speculative-draft-model-path DIR [--speculative-num-draft-tokens B]]
[--served-model-name NAME] [--api-key KEY] [--dp-size N]` (SGLang's own launch flags for these settings).

How, in detail: docs/internals.md (`demo/server.py`).
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dflash_eval.demo.replicas import Replicas
from dflash_eval.demo.request_sampling import penalties_set, sampling_request
from dflash_eval.demo.vllm_mode import VllmRoutes
from dflash_eval.demo.vllm_mode import add_arguments as add_vllm_arguments
from dflash_eval.demo.vllm_mode import authorized as vllm_authorized
from dflash_eval.demo.vllm_mode import resolve_args as resolve_vllm_args
from dflash_eval.extract.backends import bind_backend
from dflash_eval.sglang_protocol import (
    SERVER_INFO,
    VERSION,
    check_fields,
    unknown_fields,
)

# SGLANG_SIMULATE_ACC_TOKEN_MODE=fixed writes this id for every committed token (dflash_utils.py,
# apply_dflash_simulated_acceptance's fixed_token_id)
FIXED_TOKEN_ID = 100


def simulation_from_env(environ: dict[str, str]) -> dict[str, Any] | None:
    """SGLang 0.5.23's simulated acceptance switches (environ.py: LEN float, default -1; METHOD match-expected;
    TOKEN_MODE fixed), None when off (a length <= 0, as the DFlash worker's `SIMULATE_ACC_LEN > 0`). Stricter
    than SGLang where it would carry on unnoticed: a length that is no number (SGLang warns and turns it off)
    and the multinomial method (not reproduced here) stop the server, naming the variable."""
    from dflash_eval.speedup.simulate import (
        ENV_LENGTH,
        ENV_METHOD,
        ENV_TOKEN_MODE,
        MATCH_EXPECTED,
    )

    raw = environ.get(ENV_LENGTH)
    if raw is None:
        return None
    try:
        length = float(raw)
    except ValueError:
        raise SystemExit(f"{ENV_LENGTH}={raw!r} is not a number (SGLang would warn and not simulate)") from None
    if not length > 0:
        return None
    method = environ.get(ENV_METHOD, MATCH_EXPECTED)
    if method != MATCH_EXPECTED:
        raise SystemExit(f"{ENV_METHOD}={method!r}: the demo server simulates {MATCH_EXPECTED!r} only (unset it)")
    mode = environ.get(ENV_TOKEN_MODE, "fixed")
    if mode not in ("fixed", "real-draft-token"):  # spec_utils.py, check_simulate_acc_token_mode
        raise SystemExit(f"{ENV_TOKEN_MODE}={mode!r}: expected 'fixed' or 'real-draft-token' (as SGLang)")
    return {"length": length, "token_mode": mode}


def fixed_tokens(completion: list[int], stops: list[int], max_tokens: int) -> list[int]:
    """The fixed token mode's output: the prefill's token, then FIXED_TOKEN_ID for every committed one, cut at
    max_tokens, or after the first FIXED_TOKEN_ID when that id is a stop token (schedule_batch.py's finish checks)."""
    out = (completion[:1] + [FIXED_TOKEN_ID] * (len(completion) - 1))[:max_tokens]
    if FIXED_TOKEN_ID in stops and FIXED_TOKEN_ID in out[1:]:
        out = out[: out.index(FIXED_TOKEN_ID, 1) + 1]
    return out


def sglang_steps(steps: list[int], completion_tokens: int) -> list[int]:
    """The verification steps SGLang runs for a completion of `completion_tokens` (the first from prefill), from
    a full-block run that went further: steps until the output reaches that length, each counted whole."""
    taken, generated = [], 1
    for step in steps:
        if generated >= completion_tokens:
            break
        taken.append(step)
        generated += step
    return taken


def spec_counters(steps: list[int], completion_tokens: int, block_size: int) -> dict[str, Any] | None:
    """SGLang's per-request counters from the loop's steps (tokens produced per verification); None without
    a step (a completion that stopped at the prefill token: SGLang reports nothing then, verify_ct being 0)."""
    if not steps:
        return None
    correct = [step - 1 for step in steps]
    histogram = [0] * (max(correct) + 1)
    for n in correct:
        histogram[n] += 1
    proposed = len(steps) * (block_size - 1)
    return {
        "spec_accept_rate": sum(correct) / proposed if proposed else 0.0,
        "spec_accept_length": completion_tokens / len(steps),
        "spec_num_correct_drafts": sum(correct),
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": len(steps),
        "spec_correct_drafts_histogram": histogram,
    }


class Engine:
    """The target (and drafter), one request at a time (or, with replicas, one per replica)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, args.threads))
        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.target = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        eos = self.target.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.stops = [eos] if isinstance(eos, int) else list(eos)
        self.drafter = None
        self.block_size = None
        if args.speculative_algorithm is not None:
            if args.speculative_algorithm.upper() != "DFLASH" or not args.speculative_draft_model_path:
                raise SystemExit("only --speculative-algorithm DFLASH with --speculative-draft-model-path is served")
            from dflash_eval.evaluate.drafter import load_drafter

            self.drafter = load_drafter(Path(args.speculative_draft_model_path), reference=True).model.eval()
            self.block_size = int(args.speculative_num_draft_tokens or self.drafter.block_size)
        self.simulate = simulation_from_env(dict(os.environ)) if self.drafter is not None else None
        vocab = int(self.target.config.vocab_size)
        if self.simulate and self.simulate["token_mode"] == "fixed" and FIXED_TOKEN_ID >= vocab:
            raise SystemExit(
                f"SGLANG_SIMULATE_ACC_TOKEN_MODE fixed writes token {FIXED_TOKEN_ID}, outside this "
                f"target's vocabulary of {vocab}: use real-draft-token"
            )
        self.simulated_requests = 0  # the seed of each request's draws: runs repeat, requests differ
        self.counter_lock = threading.Lock()
        self.lock = threading.Lock()
        self.replicas: Replicas | None = None  # set by run() with --dp-size above 1
        self.released = False
        self.sleep_level: int | None = None  # the vLLM mode's /sleep level
        self.last_steps: list[int] = []  # the served verification steps of the last request (the vLLM mode's metrics)
        self.first_token_at: float | None = None
        self.target.register_forward_hook(self._first_forward)

    def _first_forward(self, *_: Any) -> None:
        """The first target forward of a request (its prefill) gives the first token: its time, for meta_info."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def timed_generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        drawn: dict[str, Any] | None,
        received: float,
        ignore_eos: bool = False,
    ) -> tuple[list[int], dict[str, Any] | None, dict[str, float]]:
        """generate() with its meta_info timing (seconds since `received`, the request's arrival): e2e_latency,
        and with --enable-metrics first_token_latency, queue_time and decode_throughput, as 0.5.23 computes them
        (sglang/srt/observability/req_time_stats.py: get_e2e_latency, get_first_token_latency, get_decode_throughput).
        With --dp-size above 1 a free replica computes it (demo/replicas.py)."""
        with self.counter_lock:
            self.simulated_requests += self.simulate is not None and drawn is None
            seed = self.simulated_requests
        if self.replicas is not None:
            completion, spec, steps, clock = self.replicas.generate(prompt_ids, max_new_tokens, drawn, ignore_eos, seed)
            self.last_steps = steps
        else:
            completion, spec, clock = self.generate_timed(prompt_ids, max_new_tokens, drawn, ignore_eos, seed)
        started, first, finished = clock
        timing = {"e2e_latency": finished - received}
        if self.args.enable_metrics:
            if first is not None and first > received:
                timing["first_token_latency"] = first - received
            timing["queue_time"] = started - received
            if first is not None and len(completion) > 1 and finished > first:
                timing["decode_throughput"] = (len(completion) - 1) / (finished - first)
        return completion, spec, timing

    def generate_timed(
        self, prompt_ids: list[int], max_new_tokens: int, drawn: dict[str, Any] | None, ignore_eos: bool, seed: int
    ) -> tuple[list[int], dict[str, Any] | None, tuple[float, float | None, float]]:
        """generate() one request at a time, with the perf_counter readings of its start, first token and end."""
        with self.lock:
            started = time.perf_counter()
            self.first_token_at = None
            stops = self.stops
            self.stops = [] if ignore_eos else stops  # SGLang's sampling_params.ignore_eos: run to max_new_tokens
            try:
                completion, spec = self.generate(prompt_ids, max_new_tokens, drawn, seed)
            finally:
                self.stops = stops
            return completion, spec, (started, self.first_token_at, time.perf_counter())

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, drawn: dict[str, Any] | None = None, seed: int = 1
    ) -> tuple[list[int], dict[str, Any] | None]:
        """Completion ids (the stop token included, as SGLang's output_ids) and the counters; greedy unless
        `drawn` (sampling_request's parameters) says how to sample; `seed` seeds a simulated request's draws.
        Called under the lock (generate_timed)."""
        import torch

        from dflash_eval.demo.reference import run_reference_loop

        if drawn is not None and self.simulate is not None:
            raise ValueError(
                "the demo server simulates acceptance (SGLANG_SIMULATE_ACC_LEN) for greedy requests "
                "only; send temperature 0 or unset the variable"
            )
        if self.simulate is not None:
            return self.simulated(prompt_ids, max_new_tokens, seed)
        if drawn is not None:
            from dflash_eval.demo.sampled import sampled_generate

            with torch.no_grad():
                completion, steps = sampled_generate(
                    self.drafter,
                    self.target,
                    prompt_ids,
                    max_new_tokens,
                    self.stops,
                    self.block_size or 1,
                    drawn,
                    (self.args.speculative_accept_threshold_single, self.args.speculative_accept_threshold_acc),
                )
            self.last_steps = list(steps) if self.drafter is not None else []
            return completion, (
                spec_counters(steps, len(completion), self.block_size) if self.drafter is not None else None
            )
        with torch.no_grad():
            if self.drafter is not None:
                steps, output = run_reference_loop(
                    self.drafter,
                    self.target,
                    prompt_ids,
                    max_new_tokens + self.block_size,
                    self.stops,
                    block_size=self.block_size,
                )  # full blocks up to max_new_tokens
                completion = output[len(prompt_ids) :][:max_new_tokens]
                self.last_steps = sglang_steps(steps, len(completion))  # vLLM's full blocks are cut the same way
                return completion, spec_counters(self.last_steps, len(completion), self.block_size)
            ids, cache, completion = torch.tensor([prompt_ids]), None, []
            while len(completion) < max_new_tokens:
                out = self.target(ids, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
                completion.append(token)
                if token in self.stops:
                    break
                ids = torch.tensor([[token]])
            return completion, None

    def simulated(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int
    ) -> tuple[list[int], dict[str, Any] | None]:
        """A greedy request under SGLANG_SIMULATE_ACC_LEN: the drafter and the target run every step, then each
        step commits k ~ speedup.simulate.simulated_length(length, B) tokens (forced_acceptance), full blocks
        cut as SGLang cuts them (sglang_steps), each step's drafts counted as drawn (k - 1, as SGLang's forced
        accept_len), also the step a stop token cut. real-draft-token: the k - 1 drafts and a bonus from the target
        (its argmax, or its runner-up where that was the rejected draft); fixed: every committed token is
        FIXED_TOKEN_ID, so no stop token ends it (unless that id is one)."""
        import torch

        from dflash_eval.demo.reference import run_reference_loop
        from dflash_eval.speedup.simulate import forced_acceptance

        real = self.simulate["token_mode"] == "real-draft-token"
        with (
            torch.no_grad(),
            forced_acceptance(self.target, self.simulate["length"], seed=seed) as drawn,
        ):
            _, output = run_reference_loop(
                self.drafter,
                self.target,
                prompt_ids,
                max_new_tokens + self.block_size,
                self.stops if real else [],
                block_size=self.block_size,
            )
        completion = output[len(prompt_ids) :][:max_new_tokens]
        if not real:
            completion = fixed_tokens(completion, self.stops, max_new_tokens)
        # counted as drawn: SGLang counts a step's forced k - 1 drafts raw, the step that met a stop token too
        self.last_steps = sglang_steps(drawn, len(completion))
        return completion, spec_counters(self.last_steps, len(completion), self.block_size)

    def server_info(self) -> dict[str, Any]:
        """The resolved server args as 0.5.23 reports them: the algorithm upper-cased, and for DFLASH
        num_steps and eagle_topk resolved to 1 (arg_groups/speculative_hook.py, handle_speculative_decoding
        and _handle_dflash); the block the server really serves as speculative_num_draft_tokens."""
        a, speculates = self.args, self.drafter is not None
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "served_model_name": a.served_model_name or a.model_path,
            "host": a.host,
            "port": a.port,
            "speculative_algorithm": a.speculative_algorithm.upper() if speculates else None,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_draft_tokens": self.block_size,
            "speculative_num_steps": 1 if speculates else None,
            "speculative_eagle_topk": 1 if speculates else None,
            "speculative_accept_threshold_single": a.speculative_accept_threshold_single,
            "speculative_accept_threshold_acc": a.speculative_accept_threshold_acc,
            "version": VERSION,
            "frontend": "python",
        }


def authorized(path: str, header: str | None, key: str | None) -> bool:
    """SGLang's decision for a normal route with only --api-key set: the key as a Bearer token, probes exempt."""
    if key is None or path.startswith(("/health", "/ready", "/metrics")):
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token, key)


def finish(completion: list[int], stops: list[int], max_tokens: int) -> dict[str, Any]:
    """SGLang's meta_info.finish_reason: {type: stop, matched: id} or {type: length, length: n}."""
    if completion and completion[-1] in stops:
        return {"type": "stop", "matched": completion[-1]}
    return {"type": "length", "length": max_tokens}


class Handler(BaseHTTPRequestHandler):
    engine: Engine
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the fetch log says what was asked
        pass

    def send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_body(self) -> dict[str, Any]:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return json.loads(raw) if raw.strip() else {}

    def vllm(self) -> VllmRoutes | None:
        """The vLLM mode's routes, None in the SGLang mode."""
        return VllmRoutes(self) if self.engine.args.engine == "vllm" else None

    def refused_key(self) -> bool:
        """Answer 401 as SGLang (or, in the vLLM mode, vLLM) does when the route wants the key and the request lacks it."""
        check = vllm_authorized if self.vllm() is not None else authorized
        if check(self.path.split("?", 1)[0], self.headers.get("Authorization"), self.engine.args.api_key):
            return False
        self.rfile.read(int(self.headers.get("Content-Length") or 0))  # keep the connection's framing
        self.send(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:  # http.server's name
        if self.refused_key():
            return
        path, _, query = self.path.partition("?")
        try:
            routes = self.vllm()
            self.send(*(routes.get(path, query) if routes is not None else self.get(path)))
        except ValueError as error:  # an answer with a field SGLang does not define: this server's own bug
            self.send(500, {"error": str(error)})

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        """A GET route's answer, every key checked against SGLang's own (sglang_protocol.check_fields)."""
        engine = self.engine
        name = engine.args.served_model_name or engine.args.model_path
        if path in ("/health", "/health_generate"):
            return 503 if engine.released else 200, {}
        if path == "/v1/models":
            card = check_fields(
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang",
                    "root": name,
                    "parent": None,
                    "max_model_len": 4096,
                },
                "ModelCard",
            )
            return 200, check_fields({"object": "list", "data": [card]}, "ModelList")
        if path in ("/get_model_info", "/model_info"):
            return 200, check_fields(
                {
                    "model_path": engine.args.model_path,
                    "served_model_name": name,
                    "tokenizer_path": engine.args.tokenizer_path or engine.args.model_path,
                    "is_generation": True,
                    "weight_version": "default",
                    "model_type": "qwen3_5_text",
                },
                "ModelInfo",
            )
        if path in ("/get_server_info", "/server_info"):
            return 200, check_fields(engine.server_info(), *SERVER_INFO)
        return 404, {"detail": "Not Found"}

    def do_POST(self) -> None:
        if self.refused_key():
            return
        received = time.perf_counter()  # SGLang's created_time: the request's arrival (serving_base.py)
        path, _, query = self.path.partition("?")
        try:
            body = self.read_body()
            if (routes := self.vllm()) is not None:
                self.send(*routes.post(path, query, body, received))
            elif path in ("/release_memory_occupation", "/resume_memory_occupation"):
                self.engine.released = path.startswith("/release")
                self.send(200, {})
            elif path == "/generate":
                self.send(*self.native(body, received))
            elif path in ("/v1/completions", "/v1/chat/completions"):
                self.send(*self.openai(body, chat=path.endswith("chat/completions"), received=received))
            else:
                self.send(404, {"detail": "Not Found"})
        except Exception as error:  # noqa: BLE001 (every failure answered as SGLang's error object)
            self.send(
                400,
                {
                    "object": "error",
                    "message": f"{type(error).__name__}: {error}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )

    def refuse(self, body: dict[str, Any], model: str) -> tuple[int, dict[str, Any]] | None:
        unknown = unknown_fields(body, model)
        if unknown:
            return 400, {
                "object": "error",
                "message": f"fields {unknown} are not in SGLang 0.5.23's {model}",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        penalized = penalties_set(body.get("sampling_params") if model == "GenerateReqInput" else body)
        if penalized:
            return 400, {
                "object": "error",
                "message": f"{penalized}: the demo server applies no penalties (SGLang "
                "would), so it refuses them rather than serve another distribution",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        return None

    def native(self, body: dict[str, Any], received: float) -> tuple[int, dict[str, Any]]:
        refused = self.refuse(body, "GenerateReqInput")
        if refused:
            return refused
        engine, params = self.engine, dict(body.get("sampling_params") or {})
        prompt = body.get("input_ids")
        if prompt is None:
            prompt = engine.tokenizer(body["text"], add_special_tokens=False)["input_ids"]
        max_tokens = int(params.get("max_new_tokens", 128))
        completion, spec, timing = engine.timed_generate(
            [int(t) for t in prompt],
            max_tokens,
            sampling_request(params, params.get("sampling_seed")),
            received,
            ignore_eos=bool(params.get("ignore_eos")),
        )
        stops = [] if params.get("ignore_eos") else engine.stops
        meta = check_fields(
            {
                "id": "gen-0",
                "finish_reason": finish(completion, stops, max_tokens),
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                **(spec or {}),
                **timing,
            },
            "MetaInfo",
        )
        return 200, {
            "text": engine.tokenizer.decode(completion, skip_special_tokens=True),
            "output_ids": completion,
            "meta_info": meta,
        }

    def openai(self, body: dict[str, Any], chat: bool, received: float) -> tuple[int, dict[str, Any]]:
        model = "ChatCompletionRequest" if chat else "CompletionRequest"
        refused = self.refuse(body, model)
        if refused:
            return refused
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
            max_tokens = int(body.get("max_tokens", 16))
        prompt = [int(t) for t in prompt]
        completion, spec, timing = engine.timed_generate(
            prompt, max_tokens, sampling_request(body, body.get("seed")), received
        )
        reason = finish(completion, engine.stops, max_tokens)
        text = engine.tokenizer.decode(completion, skip_special_tokens=True)
        ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": reason["type"],
            "matched_stop": reason.get("matched"),
        }
        if chat:
            choice["message"] = check_fields(
                {"role": "assistant", "content": text, "reasoning_content": None}, "ChatMessage"
            )
            if ids or body.get("return_prompt_token_ids"):
                choice["prompt_token_ids"] = prompt
            if ids:
                choice["response_token_ids"] = completion
            if body.get("return_meta_info"):
                choice["meta_info"] = check_fields(
                    {
                        "id": "chat-0",
                        "finish_reason": reason,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(completion),
                        **(spec or {}),
                        **timing,
                    },
                    "MetaInfo",
                )
        else:
            choice["text"] = text
            if ids:
                choice.update(token_ids=completion, prompt_token_ids=prompt)
        response: dict[str, Any] = {
            "id": "cmpl-0",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or engine.args.model_path,
            "choices": [choice],
            "usage": check_fields(
                {
                    "prompt_tokens": len(prompt),
                    "total_tokens": len(prompt) + len(completion),
                    "completion_tokens": len(completion),
                    "prompt_tokens_details": None,
                    "reasoning_tokens": 0,
                },
                "UsageInfo",
            ),
            "metadata": None,
        }
        if body.get("return_spec_tokens_details") and spec is not None:
            details = check_fields(
                {"spec_cap_length": 0.0, "spec_block_accept_length": 0.0, "spec_cap_lens_histogram": [], **spec},
                "SpecTokensDetails",
            )
            response["sglext"] = check_fields({"spec_tokens_details": details}, "SglExt")
        check_fields(choice, "ChatCompletionResponseChoice" if chat else "CompletionResponseChoice")
        return 200, check_fields(response, "ChatCompletionResponse" if chat else "CompletionResponse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-eval demo-server` (SGLang's own launch flags)."""
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument(
        "--speculative-accept-threshold-single",
        type=float,
        default=1.0,
        help="SGLang's: accept a draft whose target probability is at least this (1.0: lossless)",
    )
    parser.add_argument(
        "--speculative-accept-threshold-acc",
        type=float,
        default=1.0,
        help="SGLang's: accept when coin <= p / this (1.0: lossless)",
    )
    parser.add_argument("--api-key", help="the key every route but /health* wants as a Bearer token")
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="SGLang's: meta_info also gets first_token_latency, queue_time and decode_throughput",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per replica)")
    parser.add_argument(
        "--dp-size",
        "--data-parallel-size",
        type=int,
        default=1,
        help="SGLang's: replicas of the model, each serving one request at a time (worker processes here)",
    )
    add_vllm_arguments(parser)


def replica_engine(args: argparse.Namespace) -> Engine:
    """A replica's engine, in its own worker process: the torch kernels bound there too."""
    bind_backend("torch", "cpu")
    return Engine(args)


def run(args: argparse.Namespace) -> None:
    """Serve until interrupted (SIGTERM ends the process; Ctrl-C exits 0)."""
    bind_backend("torch", "cpu")  # the target runs on the CPU: never fla's Triton kernels, wherever fla imports
    if args.engine == "vllm":
        resolve_vllm_args(args)
    if args.dp_size < 1:
        raise SystemExit(f"--dp-size {args.dp_size}: give 1 or more replicas")
    Handler.engine = engine = Engine(args)
    if args.dp_size > 1:
        engine.replicas = Replicas(replica_engine, args, args.dp_size)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through `finally`: the replicas stop with it
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    replicas = f", {args.dp_size} replicas" if args.dp_size > 1 else ""
    print(f"{args.engine}-protocol test server on {args.host}:{args.port}{replicas}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)
    finally:
        if engine.replicas is not None:
            engine.replicas.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
