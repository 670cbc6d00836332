"""The fake OpenAI server (dflash_eval.testing.fake_openai_server) as a process a test runs, fetch settings that
point at it, and the requests it logged: shared by the fetch and workflow fault tests."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from dflash_eval.server.http import http_request
from dflash_eval.testing import fake_openai_server as fake_server
from dflash_eval.testing import fixtures

FAKE = Path(fake_server.__file__).resolve()


@contextlib.contextmanager
def fake_process(
    tokenizer_dir: Path, log: Path | None = None, *flags: str, model: str | None = None, port: int | None = None
):
    """Run the fake server (on `port`, else a free one); yields (process, base URL); kills it at the end."""
    port = port or fixtures.free_port()
    cmd = [
        sys.executable,
        str(FAKE),
        "--port",
        str(port),
        "--tokenizer",
        str(tokenizer_dir),
        "--model",
        model or str(tokenizer_dir),
        *flags,
    ]
    if log is not None:
        cmd += ["--request-log", str(log)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while http_request(url + "/health", timeout=1.0)[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.05)
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def fake(tokenizer_dir: Path, log: Path | None = None, *flags: str, model: str | None = None):
    """Run the fake server; yields its base URL; kills it at the end (if it did not die by itself)."""
    with fake_process(tokenizer_dir, log, *flags, model=model) as (_, url):
        yield url


def settings(tmp_path: Path, url: str, tokenizer_dir: Path, prompts: Path, **over) -> dict:
    server = {
        "kind": "external",
        "base_url": url,
        "start_command": "false",
        "stop_command": "true",
        "log_dir": str(tmp_path / "server-logs"),
    }
    return {
        "dataset": "t",
        "prompts": str(prompts),
        "server": server,
        "tokenizer": str(tokenizer_dir),
        "max_tokens": 16,
        "concurrency": 4,
        "timeout_s": 10.0,
        "retries": 3,
        "backoff_s": 0.05,
        **over,
    }


def served(log: Path, status=200) -> list[int]:
    """The prompt numbers (`Question i`) of the requests the fake server logged with `status` (200: answered;
    "arrived" with --log-arrivals: received)."""
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().split("\n")[:-1]]  # a line being written is not done
    return [int(re.search(r"Question (\d+):", r["prompt"]).group(1)) for r in rows if r["status"] == status]
