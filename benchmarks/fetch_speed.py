"""Client overhead of the fetch stage: our fetch vs a bare asyncio + openai loop, side by side, same requests.

Both talk to the same local fake OpenAI server process (tests/fake_openai_server.py: raw asyncio HTTP,
answers in microseconds), so what differs is the client: our stage adds retries, record building,
retokenization, batched fsynced appends to the partial file, the progress bar and the final write.
Runs alternate (bare, ours, bare, ours, ...) so that a machine's changing load hits both alike.
Prints a table and appends it to benchmarks/results/fetch_speed.md.

    python benchmarks/fetch_speed.py --requests 1024 --concurrency 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import print_and_record  # benchmarks/record.py (the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import helpers_server as hs  # noqa: E402  (the tests' tokenizer builder and free-port helper)

from dflash_eval import fetch  # noqa: E402
from dflash_eval.server import http_request  # noqa: E402


async def bare_loop(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> int:
    """The baseline: a semaphore, one AsyncOpenAI client, gather; returns the completion tokens."""
    import openai

    sem = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=60.0) as client:
        async def one(prompt: str) -> int:
            async with sem:
                resp = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            return resp.usage.completion_tokens

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/fetch_speed.md")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fetch-speed-"))
    tok_dir = work / "tok"
    tok = hs.build_tokenizer(tok_dir)
    prompts_file = hs.write_prompts(work / "prompts.jsonl", args.requests)
    port = hs.free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(ROOT / "tests/fake_openai_server.py"), "--port", str(port),
                               "--tokenizer", str(tok_dir), "--model", str(tok_dir)], stdout=subprocess.DEVNULL)
    try:
        while http_request(url + "/health", timeout=1.0)[0] != 200:
            time.sleep(0.05)
        settings = {"dataset": "bench", "prompts": str(prompts_file), "tokenizer": str(tok_dir),
                    "server": {"kind": "external", "base_url": url, "start_command": "false", "stop_command": "true",
                               "log_dir": str(work / "server-logs")},
                    "max_tokens": args.max_tokens, "concurrency": args.concurrency, "timeout_s": 60.0}
        # The bare loop sends the very prompts our stage sends: the chat template rendered as text.
        from dflash_eval.prompts import load_prompts

        texts = [fetch.render(tok, p.messages, {})[0] for p in load_prompts(prompts_file)]
        asyncio.run(bare_loop(url, str(tok_dir), texts[:128], args.concurrency, args.max_tokens))  # warm-up
        bare_s, ours_s = [], []
        for r in range(args.rounds):
            started = time.perf_counter()
            asyncio.run(bare_loop(url, str(tok_dir), texts, args.concurrency, args.max_tokens))
            bare_s.append(time.perf_counter() - started)
            out = work / f"out{r}.jsonl"
            started = time.perf_counter()
            records = fetch.fetch(settings, out)  # the whole stage: tokenizer load, identity, requests, files
            ours_s.append(time.perf_counter() - started)
            assert len(records) == args.requests and not out.with_name(out.name + ".partial").exists()
    finally:
        server.kill()
        server.wait()

    def rate(seconds: list[float]) -> float:
        return args.requests / statistics.median(seconds)

    bare, ours = rate(bare_s), rate(ours_s)
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, load {os.getloadavg()[0]:.1f}"
    lines = [f"## fetch speed: {args.requests} requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
             f"{args.rounds} alternating rounds; {cpu}; {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| client | seconds per round | requests/s (median) |", "|---|---|---:|",
             f"| bare asyncio + openai loop | {', '.join(f'{s:.2f}' for s in bare_s)} | {bare:,.1f} |",
             f"| dflash-eval fetch stage (whole stage) | {', '.join(f'{s:.2f}' for s in ours_s)} | {ours:,.1f} |",
             "", f"fetch stage / bare loop: **{100 * ours / bare:.1f}%** (goal >= 95%)"]
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
