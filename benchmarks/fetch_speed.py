"""Client overhead of the fetch stage: our fetch vs a bare asyncio + openai loop, side by side, same requests.

Both talk to one local fake OpenAI server process (dflash_eval/testing/fake_openai_server.py: raw asyncio HTTP, answers
at once), so what differs is the client: our stage adds prompt rendering and tokenization, retries,
record building with retokenization, batched fsynced appends to the partial file, the progress bar and
the final write. One warm-up run of each first (imports, tokenizer, connections), then rounds that
alternate (bare, ours, bare, ours, ...) so that a shared machine's changing load hits both alike.
Reported: median requests/s of each (wall clock, the goal's measure), the ratio of the medians and the
median of the per-round ratios, the client process's CPU time per request (less sensitive to other
jobs' load than the wall clock) and the garbage collector's time per round.

The garbage collector gets the same treatment on both sides. Our stage freezes the heap alive when
its requests start (fetch.heap_frozen: imported libraries, ~290k objects as transformers imports torch,
which every full collection otherwise walks, ~170 ms each); the bare loop runs under the same freeze,
or it would walk our imports' objects, which a bare loop in its own process would not have (and the
collection, about one per pair of rounds, drifted from one client's rounds to the other's over a run:
a per-round ratio of 125% falling to 71% in the 07:42 record). Before each round an untimed
gc.collect() clears the garbage earlier rounds left, as a fresh process would have none. Run both
under the same `nice`:

    nice -n 5 python benchmarks/fetch_speed.py --requests 512 --concurrency 64 --rounds 7

`--profile FILE` writes a cProfile of one more run of our stage (pstats format) after the rounds.
Prints a table and appends it to benchmarks/results/fetch_speed.md.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

ROOT = Path(__file__).resolve().parents[1]

from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.prompts import load_prompts
from dflash_eval.server.http import http_request
from dflash_eval.testing import fake_openai_server, fixtures


async def bare_loop(
    url: str, model: str, prompts: list[str] | list[list[int]], concurrency: int, max_tokens: int
) -> int:
    """The baseline: a semaphore, one AsyncOpenAI client, gather; returns the completion tokens."""
    import openai

    sem = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=60.0) as client:

        async def one(prompt: str | list[int]) -> int:
            async with sem:
                resp = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0
                )
            return resp.usage.completion_tokens

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


class GcClock:
    """Seconds the garbage collector ran, summed over its collections (a gc callback)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


def timed(run: Callable[[], object], gc_clock: GcClock) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, garbage-collector seconds) of one call."""
    wall, cpu, collecting = time.perf_counter(), time.process_time(), gc_clock.total
    run()
    return time.perf_counter() - wall, time.process_time() - cpu, gc_clock.total - collecting


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--sglang",
        action="store_true",
        help="the fake server speaks SGLang: token-id prompts in, completion token ids out (both clients)",
    )
    ap.add_argument("--profile", type=Path, help="cProfile one more run of our stage into this file")
    ap.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/fetch_speed.md")
    smoke_mode(ap, requests=48, concurrency=4, rounds=1, max_tokens=4, record=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)  # the stage's INFO summary lines are not part of the output

    work = Path(tempfile.mkdtemp(prefix="fetch-speed-"))
    tok_dir = work / "tok"
    tok = fixtures.build_tokenizer(tok_dir)
    prompts_file = fixtures.write_prompts(work / "prompts.jsonl", args.requests)
    port = fixtures.free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            fake_openai_server.__file__,
            "--port",
            str(port),
            "--tokenizer",
            str(tok_dir),
            "--model",
            str(tok_dir),
            *(["--sglang"] if args.sglang else []),
        ],
        stdout=subprocess.DEVNULL,
    )
    settings = {
        "dataset": "bench",
        "prompts": str(prompts_file),
        "tokenizer": str(tok_dir),
        "server": {
            "kind": "external",
            "base_url": url,
            "start_command": "false",
            "stop_command": "true",
            "log_dir": str(work / "server-logs"),
        },
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "timeout_s": 60.0,
    }
    # The bare loop sends the very prompts our stage sends: the chat template rendered as text, or its
    # token ids when the server takes them (SGLang).
    texts = [fetch.render(tok, p.messages, {})[1 if args.sglang else 0] for p in load_prompts(prompts_file)]
    runs = 0

    def ours() -> None:
        nonlocal runs
        runs += 1
        out = work / f"out{runs}.jsonl"
        records = fetch.fetch(settings, out)  # the whole stage: tokenizer load, identity, requests, files
        assert len(records) == args.requests and len(out.read_bytes().splitlines()) == args.requests
        out.unlink()
        # the stage keeps its records in <out>.partial for a later rerun (fetch.store); this run's next round
        # writes another file, so it would reuse nothing, but the next round starts from nothing as the first did
        out.with_name(out.name + ".partial").unlink()

    def bare() -> None:
        with fetch.heap_frozen():  # what our stage does for itself (see the module docstring)
            asyncio.run(bare_loop(url, str(tok_dir), texts, args.concurrency, args.max_tokens))

    load_before = os.getloadavg()
    bare_t, ours_t = [], []
    try:
        while http_request(url + "/health", timeout=1.0)[0] != 200:
            time.sleep(0.05)
        bare(), ours()  # warm-up: imports, tokenizer, first connections
        gc_clock = GcClock()
        for _ in range(args.rounds):
            for run, times in ((bare, bare_t), (ours, ours_t)):
                gc.collect()
                times.append(timed(run, gc_clock))
        if args.profile:
            cProfile.runctx("ours()", globals(), {"ours": ours}, str(args.profile))
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    def rate(times: list[tuple[float, float, float]]) -> float:
        return args.requests / statistics.median(t[0] for t in times)

    def cpu_ms(times: list[tuple[float, float, float]]) -> float:
        return 1000 * statistics.median(t[1] for t in times) / args.requests

    def gc_ms(times: list[tuple[float, float, float]]) -> str:
        return ", ".join(f"{1000 * t[2]:.0f}" for t in times)

    bare_rate, ours_rate = rate(bare_t), rate(ours_t)
    pair = [b[0] / o[0] for b, o in zip(bare_t, ours_t)]  # ours/bare in requests/s, round by round
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible"
    lines = [
        f"## fetch speed: {args.requests} requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
        f"{args.rounds} alternating rounds after a warm-up of each, both under fetch.heap_frozen, gc.collect() before "
        f"each; {'SGLang-style server (token ids in and out)' if args.sglang else 'OpenAI-style server (text in and out)'}; "
        f"{cpu}; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after; {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| client | wall seconds per round | requests/s (median) | client CPU ms per request (median) "
        "| GC ms per round |",
        "|---|---|---:|---:|---|",
        f"| bare asyncio + openai loop | {', '.join(f'{t[0]:.2f}' for t in bare_t)} | {bare_rate:,.1f} | "
        f"{cpu_ms(bare_t):.2f} | {gc_ms(bare_t)} |",
        f"| dflash-eval fetch stage (whole stage, in process) | {', '.join(f'{t[0]:.2f}' for t in ours_t)} | "
        f"{ours_rate:,.1f} | {cpu_ms(ours_t):.2f} | {gc_ms(ours_t)} |",
        "",
        f"fetch stage / bare loop: **{100 * ours_rate / bare_rate:.1f}%** of the median rate (goal >= 95%); per round "
        f"{', '.join(f'{100 * r:.0f}%' for r in pair)} (median {100 * statistics.median(pair):.1f}%); "
        f"client CPU per request: ours {cpu_ms(ours_t) / cpu_ms(bare_t):.2f}x the bare loop's",
    ]
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
