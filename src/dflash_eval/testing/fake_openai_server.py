"""A real, fast, deterministic OpenAI-compatible HTTP server process for the fetch fault tests and benchmark.

Run as `python -m dflash_eval.testing.fake_openai_server --port P --tokenizer DIR`; `--help` lists the faults it can
make. HTTP/1.1 with keep-alive on raw asyncio streams (no framework), so it answers in microseconds and a client
benchmark measures the client. Endpoints: GET /health, /v1/models, /get_model_info (--sglang), POST /v1/completions,
/v1/chat/completions. A completion is a pure function of the prompt's token ids (a hash picks its length and its
printable characters), so a rerun, a retry or a second client gets the same answer; its length decides "stop" (the
stop token counted in usage, never in the text, as real servers do) or "length". A retry of a faulted request is
answered, so a test of a client's retries is deterministic under any concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import string
import sys
from pathlib import Path
from typing import Any

CHARS = string.ascii_letters + string.digits + " .,"


def complete(prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens counted as a server would, finish_reason) for these prompt ids."""
    digest = hashlib.sha256(json.dumps(prompt_ids).encode()).digest()
    natural = 4 + digest[0] % 24  # tokens before the stop token
    text_len = min(natural, max_tokens)
    text = "".join(CHARS[b % len(CHARS)] for b in (digest * 4)[1 : 1 + text_len])
    if natural < max_tokens:
        return text, text_len + 1, "stop"
    return text, text_len, "length"


def fake_spec_counters(completion_tokens: int, block_size: int = 8) -> dict[str, Any]:
    """Consistent made-up counters: steps of 2 tokens (the last 2 or 3) after the prefill token."""
    verify = max(1, (completion_tokens - 1) // 2)
    steps = [2] * (verify - 1) + [completion_tokens - 1 - 2 * (verify - 1)]
    histogram = [0] * block_size
    for step in steps:
        histogram[step - 1] += 1
    return {
        "spec_accept_length": completion_tokens / verify,
        "spec_verify_ct": verify,
        "spec_num_correct_drafts": sum(steps) - verify,
        "spec_num_proposed_drafts": verify * (block_size - 1),
        "spec_correct_drafts_histogram": histogram[: max(i for i, n in enumerate(histogram) if n) + 1],
        "spec_accept_rate": (sum(steps) - verify) / (verify * (block_size - 1)),
    }


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        from tokenizers import Tokenizer

        self.args = args
        self.tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
        self.eos = self.tok.token_to_id(args.eos)
        self.count = 0
        self.seen_bodies: set[bytes] = set()
        self.new_count = 0
        self.log = open(args.request_log, "a", buffering=1) if args.request_log else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if method == "GET" and path == "/health":
            return 200, {"status": "ok"}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.args.model, "object": "model", "owned_by": "fake"}]}
        if method == "GET" and path == "/get_model_info" and self.args.sglang:
            return 200, {"model_path": self.args.model, "weight_version": "w1", "is_generation": True}
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return 404, {"detail": f"not found: {method} {path}"}
        self.count += 1
        n = self.count
        if self.args.die_after is not None and n > self.args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        req = json.loads(body)
        first_arrival = body not in self.seen_bodies
        self.seen_bodies.add(body)
        if first_arrival:
            self.new_count += 1
        if self.args.log_arrivals:
            self._log(n, req, "arrived", self.prompt_ids(path, req))
        if self.args.delay_s:
            await asyncio.sleep(self.args.delay_s)
        if self.args.reject_max_tokens_over is not None and req.get("max_tokens", 0) > self.args.reject_max_tokens_over:
            self._log(n, req, 400)
            return 400, {
                "object": "error",
                "message": f"max_tokens must be at most {self.args.reject_max_tokens_over}",
                "type": "BadRequestError",
                "code": 400,
            }
        if first_arrival and self.args.fail_every and self.new_count % self.args.fail_every == 0:
            self._log(n, req, 500)
            return 500, {"object": "error", "message": "injected failure", "code": 500}
        if first_arrival and self.args.stall_every and self.new_count % self.args.stall_every == 0:
            self._log(n, req, "stall")
            await asyncio.sleep(self.args.stall_s)
        chat = path.endswith("chat/completions")
        prompt_ids = self.prompt_ids(path, req)
        text, completion_tokens, finish = complete(prompt_ids, int(req.get("max_tokens", 16)))
        self._log(n, req, 200, prompt_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        response: dict[str, Any] = {}
        if self.args.sglang:  # SGLang 0.5.23's names: the ids include the stop token, as its output_ids do
            ids = self.encode(text) + ([self.eos] if finish == "stop" else [])
            if req.get("return_token_ids"):
                choice["response_token_ids" if chat else "token_ids"] = ids
                choice["prompt_token_ids"] = prompt_ids
            choice["matched_stop"] = self.eos if finish == "stop" else None
            if req.get("return_spec_tokens_details"):
                response["sglext"] = {"spec_tokens_details": fake_spec_counters(completion_tokens)}
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        }
        return 200, {
            "id": f"cmpl-{n}",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": self.args.model,
            "choices": [choice],
            "usage": usage,
            **response,
        }

    def prompt_ids(self, path: str, req: dict[str, Any]) -> list[int]:
        """The prompt as token ids: rendered from chat messages (ChatML), given as ids, or encoded from text."""
        if path.endswith("chat/completions"):
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in req["messages"])
            return self.encode(text + "<|im_start|>assistant\n")
        if isinstance(req["prompt"], list):
            return [int(t) for t in req["prompt"]]
        return self.encode(req["prompt"])

    def _log(self, n: int, req: dict[str, Any], status: Any, prompt_ids: list[int] | None = None) -> None:
        if self.log is not None:
            prompt = self.tok.decode(prompt_ids, skip_special_tokens=False) if prompt_ids else None
            self.log.write(json.dumps({"n": n, "status": status, "prompt": prompt}) + "\n")

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                status, payload = await self.handle(method, path.split("?", 1)[0], body)
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def main(args: argparse.Namespace) -> None:
    fake = Fake(args)
    server = await asyncio.start_server(fake.connection, "127.0.0.1", args.port, backlog=1024)
    print(f"fake openai server on {args.port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    ap.add_argument("--eos", default="<|im_end|>")
    ap.add_argument("--model", default="fake-model")
    ap.add_argument(
        "--sglang",
        action="store_true",
        help="token-id prompts; as SGLang 0.5.23: token_ids (chat: response_token_ids) and prompt_token_ids "
        "when asked return_token_ids, matched_stop, made-up counters in sglext.spec_tokens_details "
        "when asked return_spec_tokens_details",
    )
    ap.add_argument(
        "--fail-every",
        type=int,
        default=0,
        help="HTTP 500 for the N-th, 2N-th, ... new request (first arrival of a body, 1-based)",
    )
    ap.add_argument(
        "--stall-every", type=int, default=0, help="sleep --stall-s before answering every N-th new request"
    )
    ap.add_argument("--stall-s", type=float, default=5.0)
    ap.add_argument(
        "--die-after", type=int, help="SIGKILL itself when completion request N+1 arrives (in-flight requests are lost)"
    )
    ap.add_argument("--reject-max-tokens-over", type=int, help="HTTP 400 with a message, as a validation error")
    ap.add_argument("--request-log")
    ap.add_argument(
        "--log-arrivals", action="store_true", help="also log each request as it arrives (status 'arrived')"
    )
    ap.add_argument(
        "--delay-s", type=float, default=0.0, help="answer every request this late (keeps requests in flight)"
    )
    a = ap.parse_args()
    try:
        asyncio.run(main(a))
    except KeyboardInterrupt:
        sys.exit(0)
