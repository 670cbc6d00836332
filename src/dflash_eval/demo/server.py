"""A small real server that speaks SGLang 0.5.23's HTTP protocol, and speculates for real with a DFlash drafter.

Run: `dflash-eval demo-server --model-path DIR --port P
[--speculative-algorithm DFLASH --speculative-draft-model-path DIR [--speculative-num-draft-tokens B]]
[--served-model-name NAME]` (SGLang's own launch flags for these settings).

Endpoints, as SGLang 0.5.23 answers them (docs/sglang_protocol.md): GET /health, /health_generate,
/v1/models, /get_model_info, /model_info, /get_server_info, /server_info; POST /v1/completions,
/v1/chat/completions, /generate, /release_memory_occupation, /resume_memory_occupation. Request and
response bodies use only the field names of SGLang's own models (sglang_protocol.PROTOCOL_FIELDS, read from
its source); an unknown request field is answered 400 here, where SGLang would ignore it silently, so that a
misspelt flag fails a test instead of passing unnoticed.

Greedy only (temperature 0). Without a drafter the target decodes token by token. With one, every
request runs the reference loop (`dflash.model.dflash_generate`) with exact rollback of the hybrid
target's cache (reference.exact_target_rollback, as SGLang's per-token states give), with blocks of
`--speculative-num-draft-tokens` tokens (default: the drafter's own), and the counters are computed as
SGLang computes them from its steps: `spec_verify_ct` = steps, `spec_num_correct_drafts` = accepted draft
tokens (bonus excluded), the histogram of accepted drafts per step, `spec_num_proposed_drafts` =
steps x (B - 1), `spec_accept_length` = completion tokens / steps. One difference, stated: SGLang counts
a last step's accepted drafts before cutting the output at the stop token or max_tokens, while the
reference loop verifies a shortened last block and cuts the step; here the last step counts as the loop
cut it, so `spec_num_correct_drafts` can be up to B - 1 lower than a real SGLang's on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dflash_eval.demo.sglang_protocol import unknown_fields
from dflash_eval.extract.backends import bind_backend

SGLANG_VERSION = "0.5.23"


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
    return {"spec_accept_rate": sum(correct) / proposed if proposed else 0.0,
            "spec_accept_length": completion_tokens / len(steps),
            "spec_num_correct_drafts": sum(correct), "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": len(steps), "spec_correct_drafts_histogram": histogram}


class Engine:
    """The target (and drafter), one request at a time."""

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
        self.lock = threading.Lock()
        self.released = False

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], dict[str, Any] | None]:
        """Greedy completion ids (the stop token included, as SGLang's output_ids) and the counters."""
        import torch

        from dflash_eval.demo.reference import online_acceptance

        with self.lock, torch.no_grad():
            if self.drafter is not None:
                steps, output = online_acceptance(self.drafter, self.target, prompt_ids, max_new_tokens,
                                                  self.stops, block_size=self.block_size)
                completion = output[len(prompt_ids):]
                return completion, spec_counters(steps, len(completion), self.block_size)
            ids, cache, completion = torch.tensor([prompt_ids]), None, []
            while len(completion) < max_new_tokens:
                out = self.target(ids, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
                completion.append(token)
                if token in self.stops:
                    break
                ids = torch.tensor([[token]])
            return completion, None

    def server_info(self) -> dict[str, Any]:
        a = self.args
        return {"model_path": a.model_path, "tokenizer_path": a.tokenizer_path or a.model_path,
                "served_model_name": a.served_model_name or a.model_path, "host": a.host, "port": a.port,
                "speculative_algorithm": a.speculative_algorithm if self.drafter is not None else None,
                "speculative_draft_model_path": a.speculative_draft_model_path,
                "speculative_num_draft_tokens": self.block_size, "speculative_num_steps": None,
                "speculative_eagle_topk": None, "version": SGLANG_VERSION, "frontend": "python"}


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

    def do_GET(self) -> None:  # http.server's name
        engine, path = self.engine, self.path.split("?", 1)[0]
        name = engine.args.served_model_name or engine.args.model_path
        if path in ("/health", "/health_generate"):
            self.send(503 if engine.released else 200, {})
        elif path == "/v1/models":
            self.send(200, {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                                        "owned_by": "sglang", "root": name, "parent": None,
                                                        "max_model_len": 4096}]})
        elif path in ("/get_model_info", "/model_info"):
            self.send(200, {"model_path": engine.args.model_path, "served_model_name": name,
                            "tokenizer_path": engine.args.tokenizer_path or engine.args.model_path,
                            "is_generation": True, "weight_version": "default", "model_type": "qwen3_5_text"})
        elif path in ("/get_server_info", "/server_info"):
            self.send(200, engine.server_info())
        else:
            self.send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self.read_body()
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                self.engine.released = path.startswith("/release")
                self.send(200, {})
            elif path == "/generate":
                self.send(*self.native(body))
            elif path in ("/v1/completions", "/v1/chat/completions"):
                self.send(*self.openai(body, chat=path.endswith("chat/completions")))
            else:
                self.send(404, {"detail": "Not Found"})
        except Exception as error:  # noqa: BLE001 (every failure answered as SGLang's error object)
            self.send(400, {"object": "error", "message": f"{type(error).__name__}: {error}", "type": "BadRequestError",
                            "param": None, "code": 400})

    def refuse(self, body: dict[str, Any], model: str) -> tuple[int, dict[str, Any]] | None:
        unknown = unknown_fields(body, model)
        if unknown:
            return 400, {"object": "error", "message": f"fields {unknown} are not in SGLang 0.5.23's {model}",
                         "type": "BadRequestError", "param": None, "code": 400}
        if float(body.get("temperature") or 0.0) != 0.0 and model != "GenerateReqInput":
            return 400, {"object": "error", "message": "this test server decodes greedily only (temperature 0)",
                         "type": "BadRequestError", "param": None, "code": 400}
        return None

    def native(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        refused = self.refuse(body, "GenerateReqInput")
        if refused:
            return refused
        engine, params = self.engine, dict(body.get("sampling_params") or {})
        prompt = body.get("input_ids")
        if prompt is None:
            prompt = engine.tokenizer(body["text"], add_special_tokens=False)["input_ids"]
        max_tokens = int(params.get("max_new_tokens", 128))
        completion, spec = engine.generate([int(t) for t in prompt], max_tokens)
        meta = {"id": "gen-0", "finish_reason": finish(completion, engine.stops, max_tokens),
                "prompt_tokens": len(prompt), "completion_tokens": len(completion), **(spec or {})}
        return 200, {"text": engine.tokenizer.decode(completion, skip_special_tokens=True),
                     "output_ids": completion, "meta_info": meta}

    def openai(self, body: dict[str, Any], chat: bool) -> tuple[int, dict[str, Any]]:
        model = "ChatCompletionRequest" if chat else "CompletionRequest"
        refused = self.refuse(body, model)
        if refused:
            return refused
        engine = self.engine
        if chat:
            text = engine.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False,
                                                        **(body.get("chat_template_kwargs") or {}))
            prompt = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 128)
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                prompt = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            max_tokens = int(body.get("max_tokens", 16))
        prompt = [int(t) for t in prompt]
        completion, spec = engine.generate(prompt, max_tokens)
        reason = finish(completion, engine.stops, max_tokens)
        text = engine.tokenizer.decode(completion, skip_special_tokens=True)
        ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason["type"],
                                  "matched_stop": reason.get("matched")}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "reasoning_content": None}
            if ids or body.get("return_prompt_token_ids"):
                choice["prompt_token_ids"] = prompt
            if ids:
                choice["response_token_ids"] = completion
            if body.get("return_meta_info"):
                choice["meta_info"] = {"id": "chat-0", "finish_reason": reason, "prompt_tokens": len(prompt),
                                       "completion_tokens": len(completion), **(spec or {})}
        else:
            choice["text"] = text
            if ids:
                choice.update(token_ids=completion, prompt_token_ids=prompt)
        response: dict[str, Any] = {
            "id": "cmpl-0", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.get("model") or engine.args.model_path, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(completion),
                      "completion_tokens": len(completion), "prompt_tokens_details": None, "reasoning_tokens": 0},
            "metadata": None}
        if body.get("return_spec_tokens_details") and spec is not None:
            response["sglext"] = {"spec_tokens_details": {"spec_cap_length": 0.0, "spec_block_accept_length": 0.0,
                                                          "spec_cap_lens_histogram": [], **spec}}
        return 200, response


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
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


def run(args: argparse.Namespace) -> None:
    """Serve until interrupted (SIGTERM ends the process; Ctrl-C exits 0)."""
    bind_backend("torch", "cpu")  # the target runs on the CPU: never fla's Triton kernels, wherever fla imports
    Handler.engine = Engine(args)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"sglang-protocol test server on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
