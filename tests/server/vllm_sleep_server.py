"""A tiny stdlib server with vLLM 0.34.0's sleep-mode surface, for the release kind's fault tests (the demo
server's vLLM mode answers the same routes with a real model; this one starts in a blink).

`python vllm_sleep_server.py --port P [--state FILE] [--memory-file FILE] [--no-sleep-mode] [--keeps-memory]`:
GET /health (200, asleep too, as vLLM's), /version, /is_sleeping; POST /sleep?level=N and /wake_up, registered
only with VLLM_SERVER_DEV_MODE=1 (404 otherwise, as vLLM's routers); /sleep refused (500, as the engine's
error) without sleep mode. --state: appends `started`, then `sleep:<level>` / `wake_up` per call. --memory-file:
the GPU memory in use (tests.support.servers' BUSY_MIB while awake, FREE_MIB asleep; --keeps-memory: always busy).
"""

from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

BUSY_MIB, FREE_MIB = 80000, 1000  # tests.support.servers' values (that module is not imported by a helper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--state", type=Path)
    ap.add_argument("--memory-file", type=Path)
    ap.add_argument("--no-sleep-mode", action="store_true")
    ap.add_argument("--keeps-memory", action="store_true")
    a = ap.parse_args()
    dev = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
    asleep = [False]

    def note(word: str) -> None:
        if a.state:
            with a.state.open("a") as out:
                out.write(word + "\n")

    def memory() -> None:
        if a.memory_file:
            a.memory_file.write_text(str(BUSY_MIB if a.keeps_memory or not asleep[0] else FREE_MIB))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self.answer(200, {})
            elif path == "/version":
                self.answer(200, {"version": "0.34.0"})
            elif path == "/is_sleeping" and dev:
                self.answer(200, {"is_sleeping": asleep[0]})
            else:
                self.answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            path, _, query = self.path.partition("?")
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if path == "/sleep" and dev:
                if a.no_sleep_mode:
                    self.answer(500, {"error": "Sleep mode is not enabled (--enable-sleep-mode)"})
                    return
                level = int((parse_qs(query).get("level") or ["1"])[0])
                asleep[0] = True
                note(f"sleep:{level}")
                memory()
                self.answer(200, {"status": "sleeping", "level": level})
            elif path == "/wake_up" and dev:
                asleep[0] = False
                note("wake_up")
                memory()
                self.answer(200, {"status": "awake", "tags": None})
            else:
                self.answer(404, {"detail": "Not Found"})

    note("started")
    memory()
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
