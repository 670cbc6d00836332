"""Offline = online at T > 0, on one device: the served sampled dataset and dflash_generate's sampled loop.

Two checks, each through the workflow's own stages (extract with target log-probs, evaluate with
`verify: [target_only, rejection]`) on `--device` in each `--dtypes` entry:

- **served**: the demo server (SGLang 0.5.23's DFlash protocol and its target-only sampled verify; its target on
  this machine's CPU, as the GPU demo serves it) speculating with `--drafter`, fetched at `--temperature`,
  `--top-p`, `--top-k` (`--n` draws of each prompt). Offline target_only on each served completion must equal the
  server's counters per request (report.online.compare_request, as the T = 0 online panel). The rejection
  section's share of samples with a verified token outside dflash's top-k/top-p support on this dtype's logits
  (bf16: the server's fp32 logits differ from the extraction's near the cut) and the cache check at T > 0 beside.
- **monte carlo**: `--runs` seeded `dflash_generate(temperature, top_p, top_k)` runs (exact rollback,
  demo/reference.py) from the served prompts; each run's output becomes a completions record, and the rejection
  scheme's expected tau E_i and variance V_i given that output are the evaluate stage's. Z = sum(tau_i - E_i) /
  sqrt(sum V_i) has mean 0 and variance 1 when the scheme is exact (offline and live in one dtype; in bf16 the two
  sides' logits differ slightly, which Z measures too).

    python benchmarks/fidelity_sampled.py --target resources/demo/target --drafter resources/demo/drafters/step900 \\
        --prompts resources/prompts/demo_code.jsonl --device cuda:0 --backend fla --dtypes bfloat16 float32

Prints the tables and appends them to benchmarks/results/fidelity.md (beside the T = 0 rows of fidelity.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import multiprocessing
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    checkout_commit,
    print_and_record,
    smoke_mode,
)

from dflash_eval.completions import read_completions, serialize
from dflash_eval.demo.reference import run_reference_loop
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.stage import stop_token_ids
from dflash_eval.extract.backends import use_backend
from dflash_eval.extract.target import load_target, parse_dtype
from dflash_eval.methods import REJECTION, TARGET_ONLY, chain_method
from dflash_eval.report.online import compare_request, request_counters
from dflash_eval.testing.offline import extract_and_evaluate

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "fidelity.md"
DTYPES = ("bfloat16", "float32")


def sampling(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0}


def serve_and_fetch(args: argparse.Namespace, block: int, out: Path) -> list[dict]:
    """The demo server of --target speculating with --drafter (SGLang's protocol), fetched at the sampling asked."""
    from dflash_eval.fetch.stage import fetch
    from dflash_eval.server.control import ServerController
    from dflash_eval.testing.fixtures import free_port

    port = free_port()
    command = (
        f"OMP_NUM_THREADS={args.server_threads} exec {sys.executable} -m dflash_eval.cli demo-server "
        f"--model-path {args.target} --port {port} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {args.drafter} --speculative-num-draft-tokens {block} "
        f"--threads {args.server_threads}"
    )
    settings = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "command": command,
        "health_timeout_s": 300.0,
        "stop_grace_s": 5.0,
        "log_dir": str(out.parent / "server-logs"),
    }
    controller = ServerController(settings)
    controller.ensure_up()
    try:
        return fetch(
            {
                "dataset": "fidelity-sampled",
                "prompts": str(args.prompts),
                "max_samples": args.samples,
                "server": settings,
                "tokenizer": str(args.target),
                "max_tokens": args.max_tokens,
                "concurrency": 4,
                "n": args.n,
                "sampling_seed": 0,
                **sampling(args),
            },
            out,
        )
    finally:
        controller.stop_if_launched()


def evaluate(args: argparse.Namespace, dtype: str, drafter, completions: Path, work: Path) -> tuple[dict, dict]:
    """extract (with target log-probs) + evaluate under both schemes: (metrics, id -> target_only chain steps)."""
    target = {"path": str(args.target), "dtype": dtype, "device": args.device, "backend": args.backend}
    hidden = work / f"hidden-{completions.stem}-{dtype}"
    metrics, rows = extract_and_evaluate(
        target,
        args.drafter,
        drafter,
        completions,
        hidden,
        "fidelity-sampled",
        target_logprobs=True,
        verify=[TARGET_ONLY, REJECTION],
        bootstrap=args.bootstrap,
    )
    metrics["first_token_outside"] = first_token_outside(hidden, drafter.layer_ids)
    chain = chain_method(drafter.block_size)
    return metrics, {
        str(r["id"]): [int(x) for x in str(r["acceptance_lengths"]).split()] for r in rows if r["method"] == chain
    }


def _evaluate_fresh(args: argparse.Namespace, dtype: str, completions: Path, work: Path) -> tuple[dict, dict]:
    faulthandler.dump_traceback_later(240)  # where a stalled evaluation waits, in its log (it goes on running)
    try:
        return evaluate(args, dtype, load_drafter(args.drafter), completions, work)
    finally:
        faulthandler.cancel_dump_traceback_later()


def evaluate_apart(args: argparse.Namespace, dtype: str, completions: Path, work: Path) -> tuple[dict, dict]:
    """`evaluate` in a fresh process of its own, unless --in-process: on an H200 the second extract + evaluate of
    one CUDA process stalled after the extraction (the fp32 served check after bf16; the Monte Carlo's after the
    served one), while each ran in the first place of its process."""
    if args.in_process:
        return _evaluate_fresh(args, dtype, completions, work)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_evaluate_fresh, (args, dtype, completions, work))


def first_token_outside(hidden: Path, layer_ids: list[int]) -> int:
    """Samples whose first completion token (drawn at prefill from flashinfer's joint filter, never verified) lies
    outside dflash's support: the ones a support check that includes it would drop."""
    from dflash_eval.cache.store import HiddenCache

    cache = HiddenCache(hidden)
    count = 0
    for entry in cache.samples:
        states = cache.load_sample(str(entry["id"]), layer_ids)
        if len(states.input_ids) > states.prompt_len and not bool(torch.isfinite(states.logprob[states.prompt_len])):
            count += 1
    return count


def served_check(records: list[dict], metrics: dict, steps: dict, block: int) -> dict:
    """Per request: offline target_only against the server's counters; the rejection scheme's support share."""
    compared = {str(r["id"]): compare_request(request_counters(r), steps[str(r["id"])], block) for r in records}
    rejection = metrics["rejection"]
    chain = rejection["methods"][chain_method(block)]
    return {
        "requests": len(compared),
        "equal": sum(c["equal"] for c in compared.values()),
        "exact": sum(c["exact"] for c in compared.values()),
        "unequal_ids": [i for i, c in compared.items() if not c["equal"]],
        "tau_target_only": metrics["chain"]["tau_mean_of_samples"],
        "tau_rejection": chain["tau_mean_of_samples"],
        "rejection_samples": chain["samples"],
        "outside_support": rejection["outside_support"],
        "first_token_outside": metrics["first_token_outside"],
        "skipped": len(metrics["diagnostics"]["samples_skipped"]),
        "sampled_check": metrics["diagnostics"]["sampled_check"],
    }


def live_records(args: argparse.Namespace, dtype: str, prompts: list[list[int]], stops: list[int]) -> list[dict]:
    """--runs seeded dflash_generate runs at the sampling asked, as completions records (plus their steps)."""
    target, _ = load_target(args.target, dtype, args.device)
    drafter = load_drafter(args.drafter).model.to(device=target.device, dtype=parse_dtype(dtype)).eval()
    drawn = sampling(args)
    records = []
    started = time.perf_counter()
    with use_backend(args.backend, args.device, target) as backend:
        for done, seed in enumerate(range(args.first_seed, args.first_seed + args.runs)):
            if done and done % 25 == 0:
                progress(f"{dtype}: {done} of {args.runs} dflash_generate runs", started)
            prompt = prompts[seed % len(prompts)]
            torch.manual_seed(seed)
            steps, ids = run_reference_loop(
                drafter,
                target,
                prompt,
                args.mc_max_tokens,
                stops,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=max(args.top_k, 0),
            )
            records.append(
                {
                    "id": f"run{seed}#s0",
                    "prompt_token_ids": prompt,
                    "completion_token_ids": ids[len(prompt) :],
                    "request": {"max_tokens": args.mc_max_tokens},
                    "completion_ids_source": "server",
                    "token_check": {},
                    "sampling": {**drawn, "seed": seed},
                    "live_steps": steps,
                }
            )
        backend.verify()
    del target, drafter
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


def monte_carlo(records: list[dict], metrics: dict, block: int) -> dict:
    """Z of the realised live tau against the rejection scheme's expectation given each run's own output."""
    per_sample = {row["id"]: row for row in metrics["rejection"]["methods"][chain_method(block)]["per_sample"]}
    residual = variance = 0.0
    realised, expected = [], []
    for record in records:
        steps, row = record["live_steps"], per_sample.get(record["id"])
        if not steps or row is None:
            continue
        realised.append(sum(steps) / len(steps))
        expected.append(row["expected_tau"])
        residual += realised[-1] - row["expected_tau"]
        variance += row["tau_variance"]
    z = residual / math.sqrt(variance) if variance > 0 else math.nan
    return {
        "runs": len(realised),
        "z": z,
        # the sums Z is made of: the runs of several calls (--first-seed) combine as sum/sqrt(sum)
        "residual_sum": residual,
        "variance_sum": variance,
        "mean_expected_tau": sum(expected) / max(len(expected), 1),
        "mean_realised_tau": sum(realised) / max(len(realised), 1),
        "outside_support": metrics["rejection"]["outside_support"],
    }


def heading(meta: dict) -> list[str]:
    drawn = f"T {meta['temperature']:g}, top-k {meta['top_k']}, top-p {meta['top_p']:g}"
    return [
        f"### {meta['date']}: {meta['device']}, backend {meta['backend']}, at {drawn} (commit {meta['commit']})",
        "",
        f"Command: `{meta['command']}`",
        "",
    ]


def served_table(results: dict) -> list[str]:
    lines = [
        "| dtype | served requests | offline target_only = counters per request | tau target_only | "
        "tau rejection (expected; samples) | samples skipped | first token outside dflash's support (taken as "
        "given) | samples with a verified token outside it (tokens) | support share | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, r in results.items():
        s = r["served"]
        out, check = s["outside_support"], s["sampled_check"] or {}
        share = "–" if check.get("support_share") is None else f"{check['support_share']:.4f}"
        lines.append(
            f"| {dtype} | {s['requests']} | {s['equal']} of {s['requests']} ({s['exact']} exactly) "
            f"| {s['tau_target_only']:.3f} | {s['tau_rejection']:.3f}; {s['rejection_samples']} "
            f"| {s['skipped']} | {s['first_token_outside']} of {s['requests']} "
            f"| {out['samples']} of {out['samples_scored']} ({out['tokens']}) | {share} | {r['seconds']:.0f} |"
        )
    return lines


def monte_carlo_table(dtype: str, m: dict) -> list[str]:
    return [
        "| dtype | dflash_generate runs | mean realised tau | mean expected tau | Z | samples outside support "
        "| seconds (runs; their evaluation) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| {dtype} | {m['runs']} | {m['mean_realised_tau']:.3f} | {m['mean_expected_tau']:.3f} | {m['z']:+.2f} "
        f"| {m['outside_support']['samples']} | {m['run_seconds']:.0f}; {m['evaluate_seconds']:.0f} |",
    ]


def combined_table(paths: list[Path]) -> list[str]:
    """One Z over the Monte Carlo runs of several calls: Z = sum of residuals / sqrt(sum of variances), the same
    statistic one call of all the runs gives. The calls must share commit, device, backend and sampling, and their
    seeds must not overlap."""
    parts = [json.loads(path.read_text()) for path in paths]
    same = ("commit", "device", "backend", "temperature", "top_p", "top_k", "min_p")
    for path, part in zip(paths, parts):
        differs = [key for key in same if part["meta"].get(key) != parts[0]["meta"].get(key)]
        if differs:
            raise SystemExit(f"{path}: differs from {paths[0]} in {differs}: not one experiment")
    seeds = [tuple(part["meta"].get("seeds", ())) for part in parts]
    if len({s for r in seeds for s in range(*r)}) != sum(len(range(*r)) for r in seeds):
        raise SystemExit(f"{', '.join(map(str, paths))}: their seed ranges {seeds} overlap")
    lines = heading(parts[0]["meta"]) + [
        f"Combined from {len(parts)} calls (seeds {', '.join(f'{a}-{b - 1}' for a, b in seeds)}): "
        "`python benchmarks/fidelity_sampled.py --combine " + " ".join(p.name for p in paths) + "`",
        "",
        "| dtype | dflash_generate runs | mean realised tau | mean expected tau | Z | Z of each call "
        "| samples outside support |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    dtypes = sorted({d for part in parts for d, r in part["results"].items() if "monte_carlo" in r})
    for dtype in dtypes:
        runs = [p["results"][dtype]["monte_carlo"] for p in parts if "monte_carlo" in p["results"].get(dtype, {})]
        n = sum(m["runs"] for m in runs)
        residual, variance = sum(m["residual_sum"] for m in runs), sum(m["variance_sum"] for m in runs)
        realised = sum(m["mean_realised_tau"] * m["runs"] for m in runs) / max(n, 1)
        expected = sum(m["mean_expected_tau"] * m["runs"] for m in runs) / max(n, 1)
        z = residual / math.sqrt(variance) if variance > 0 else math.nan
        outside = sum(m["outside_support"]["samples"] for m in runs)
        each = " ".join(f"{m['z']:+.2f}" for m in runs)
        lines.append(f"| {dtype} | {n} | {realised:.3f} | {expected:.3f} | {z:+.2f} | {each} | {outside} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    needed = not {"--smoke", "--combine"} & set(sys.argv)  # --smoke builds its own tiny inputs; --combine reads JSON
    parser.add_argument("--target", type=Path, required=needed, help="the target's HF directory (the served one)")
    parser.add_argument("--drafter", type=Path, required=needed, help="the served drafter's HF directory")
    parser.add_argument("--prompts", type=Path, required=needed, help="a prompts JSONL (fetch's input)")
    parser.add_argument("--samples", type=int, default=16, help="prompts served (a seeded subset)")
    parser.add_argument("--n", type=int, default=2, help="draws per prompt")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--runs", type=int, default=200, help="seeded dflash_generate runs (0: no monte carlo)")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first run's seed: calls of disjoint seeds combine their Z"
    )
    parser.add_argument("--mc-max-tokens", type=int, default=48)
    parser.add_argument("--mc-dtypes", nargs="+", default=["bfloat16"], choices=DTYPES)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backend", default="fla", choices=["fla", "torch"])
    parser.add_argument(
        "--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES, help="served checks (none: Monte Carlo only)"
    )
    parser.add_argument("--server-threads", type=int, default=4)
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--record", type=Path, default=RECORD)
    parser.add_argument(
        "--in-process", action="store_true", help="every extract + evaluate in this process (see evaluate_apart)"
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only combine the Monte Carlo of several calls' --json files (disjoint --first-seed ranges) into one Z",
    )
    # the code path on a tiny random target and drafter on the CPU (torch kernels), fp32: not the figures
    smoke_mode(
        parser,
        device="cpu",
        backend="torch",
        dtypes=["float32"],
        mc_dtypes=["float32"],
        samples=2,
        n=2,
        max_tokens=12,
        runs=4,
        mc_max_tokens=12,
        server_threads=1,
        bootstrap=20,
        record=None,
    )
    args = parser.parse_args()
    if args.combine:
        print_and_record(combined_table(args.combine), args.record)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from dflash_eval.testing.eval_project import tiny_served
            from dflash_eval.testing.fixtures import write_prompts

            args.target, _, args.drafter = tiny_served(Path(tmp) / "tiny")
            args.prompts = write_prompts(Path(tmp) / "prompts.jsonl", args.samples)
        run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> None:
    """The served check for every dtype, recorded as soon as it is done, then each Monte Carlo table as it is
    done: a run cut short by a time limit keeps every table it finished."""
    drafter = load_drafter(args.drafter)
    block = drafter.block_size
    device = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else platform.processor() or "cpu"
    )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "backend": args.backend,
        "commit": checkout_commit(ROOT),
        "command": f"python benchmarks/fidelity_sampled.py {' '.join(sys.argv[1:])}",
        "seeds": [args.first_seed, args.first_seed + args.runs],
        **sampling(args),
    }
    served_path = work / "served.jsonl"
    started = time.perf_counter()
    records = serve_and_fetch(args, block, served_path)
    read_completions(served_path)  # the served file stays readable (a damaged one is an error here)
    progress(f"served and fetched {len(records)} requests", started)
    stops = stop_token_ids({"target": {"path": str(args.target)}, "stop_token_ids": None})
    results: dict[str, dict] = {}
    for dtype in args.dtypes:
        started = time.perf_counter()
        metrics, steps = evaluate_apart(args, dtype, served_path, work)
        results[dtype] = {
            "served": served_check(records, metrics, steps, block),
            "seconds": time.perf_counter() - started,
        }
        progress(f"{dtype}: served requests evaluated", started)
    print_and_record(heading(meta) + (served_table(results) if results else ["(no served check)"]), args.record)
    write_json(args, meta, results)
    for dtype in args.mc_dtypes if args.runs else []:
        started = time.perf_counter()
        prompts = [r["prompt_token_ids"] for r in records[:: args.n]]
        live = live_records(args, dtype, prompts, stops)
        run_seconds = time.perf_counter() - started
        progress(f"{dtype}: {len(live)} dflash_generate runs", started)
        path = work / f"live-{dtype}.jsonl"
        path.write_bytes(b"".join(serialize({k: v for k, v in r.items() if k != "live_steps"}) for r in live))
        evaluated = time.perf_counter()
        mc_metrics, _ = evaluate_apart(args, dtype, path, work)
        progress(f"{dtype}: the runs evaluated", evaluated)
        results.setdefault(dtype, {})["monte_carlo"] = {
            **monte_carlo(live, mc_metrics, block),
            "run_seconds": run_seconds,
            "evaluate_seconds": time.perf_counter() - evaluated,
        }
        print_and_record(monte_carlo_table(dtype, results[dtype]["monte_carlo"]), args.record)
        write_json(args, meta, results)


def progress(what: str, since: float) -> None:
    print(f"[fidelity_sampled] {what} in {time.perf_counter() - since:.1f} s", flush=True)


def write_json(args: argparse.Namespace, meta: dict, results: dict) -> None:
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
