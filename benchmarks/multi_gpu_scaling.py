"""Evaluations spread over the GPUs of one host: wall time, per-GPU utilisation and speedup against one GPU.

Each evaluation is its own process, as under `snakemake --resources gpu=K`: it claims a GPU through the stage's
per-GPU locks (`evaluate.gpu.claim_device`, with a claim record), builds a drafter of the shape with random weights
(evaluator_speed.py's shapes: 27b is Qwen3.6-27B-DFlash's, LM head of 248,320 rows included), cached-state-like
features and token sequences accepted at --tau, and runs the stage's trajectory evaluator over --samples samples
with the default method set. The driver starts --jobs of them, at most K at once (what Snakemake's `gpu=K`
resource allows; the driver stands in for its scheduler, nothing else), for each K in --gpus (those above the
visible count are skipped), and samples `nvidia-smi` meanwhile. Rows: wall time, speedup = wall(1 GPU) /
wall(K), efficiency = speedup / K (the goal for the 27b shape: >= 0.9), the most jobs at once and the overlaps on
one GPU read back from the claim records (`evaluate.placement`: must be 0), the mean utilisation per GPU.
Each job's own start (imports, building the drafter) is part of the wall time, as it is in a workflow. With
--fake-gpus (the smoke, CPU tests) each job is forked from the driver after its imports instead, so that a run
takes seconds: the locks, records and check are the same, the start-up cost is not measured there.

    python benchmarks/multi_gpu_scaling.py --shape 27b --gpus 1 2 4 --jobs 8
    python benchmarks/multi_gpu_scaling.py --smoke        # CPU, fake GPUs (the lock files are real), seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.evaluate import placement

ROOT = Path(__file__).resolve().parents[1]


def evaluate_one(args: argparse.Namespace, record: str) -> dict:
    """One evaluation: claim a GPU (or a fake one, evaluating on the CPU), build, evaluate; its seconds."""
    import torch
    from evaluator_speed import (
        DEFAULT_METHODS,
        SHAPES,
        build_samples,
        drafter_config,
        trajectory,
    )

    from dflash_eval.evaluate.blocks import BlockDrafter
    from dflash_eval.evaluate.gpu import claim_device, claim_gpu

    if args.fake_gpus:
        claim_gpu(None, "cuda", [f"GPU-fake{i}" for i in range(args.fake_gpus)], poll_s=0.02, record=record, job=record)
        device = torch.device("cpu")
    else:
        device = claim_device("cuda", poll_s=0.1, record=record, job=record)
    from dflash import DFlashDraftModel

    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    config = drafter_config(**SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head = (
            torch.randn(config.vocab_size, config.hidden_size)
            * 0.02
            * torch.exp(1.5 * torch.randn(config.vocab_size, 1))
        ).to(dtype)  # spread norms: evaluator_speed.py
    runner = BlockDrafter(model, embed, head, config.dflash_config["mask_token_id"]).to(device)
    samples = build_samples(runner, args.samples, args.seq_len, args.prompt_len, args.tau, seed=1)
    methods = {"block_sizes": list(range(2, config.block_size + 1)), **DEFAULT_METHODS}
    built = time.perf_counter()
    seconds, tokens, _, _ = trajectory(runner, samples, methods, rows=512, split=4)
    return {"build_s": built - started, "evaluate_s": seconds, "tokens": tokens}


def _forked(args: argparse.Namespace, record: str, out: str) -> int:
    """A forked job (fake GPUs): its pid; the child runs one evaluation, writes its output to `out`, ends its claim
    (a forked child leaves through os._exit, which skips atexit) and exits 0, or 1 after printing why."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        import torch

        from dflash_eval.evaluate.gpu import release_all

        torch.set_num_threads(1)
        Path(out).write_text(json.dumps(evaluate_one(args, record)))
        release_all()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_jobs(args: argparse.Namespace, k: int, records: Path) -> tuple[float, list[dict], placement.UtilisationSampler]:
    """--jobs evaluations, at most `k` at once, each its own process; wall seconds, their outputs, the sampler."""
    command = [
        sys.executable,
        __file__,
        "--shape",
        args.shape,
        "--dtype",
        args.dtype,
        "--samples",
        str(args.samples),
        "--seq-len",
        str(args.seq_len),
        "--prompt-len",
        str(args.prompt_len),
        "--tau",
        str(args.tau),
    ]
    environment = {**os.environ, "DFLASH_EVAL_GPU_LOCKS": str(records / "locks")}
    os.environ["DFLASH_EVAL_GPU_LOCKS"] = environment["DFLASH_EVAL_GPU_LOCKS"]  # forked jobs read it here

    def one(index: int) -> dict:
        record = records / f"job{index}{placement.SUFFIX}"
        done = subprocess.run([*command, "--worker", str(record)], capture_output=True, text=True, env=environment)
        if done.returncode != 0:
            raise RuntimeError(f"job {index} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    if args.fake_gpus:  # fake GPUs have no utilisation to sample: no sampler thread beside the forks
        sampler = placement.UtilisationSampler()  # never entered: no thread
        sampler.error = "fake GPUs: no utilisation to sample"
        started = time.perf_counter()
        outputs = _run_forked(args, k, records)
        return time.perf_counter() - started, outputs, sampler
    with placement.UtilisationSampler(interval_s=args.sample_s) as sampler, ThreadPoolExecutor(k) as pool:
        started = time.perf_counter()
        outputs = list(pool.map(one, range(args.jobs)))
        wall = time.perf_counter() - started
    return wall, outputs, sampler


def _run_forked(args: argparse.Namespace, k: int, records: Path) -> list[dict]:
    """The jobs forked from this thread, at most `k` at once, none while another thread runs: filelock (4.x, which
    huggingface_hub imports) refuses an os.fork made while another thread is inside one."""
    paths = [(str(records / f"job{i}{placement.SUFFIX}"), records / f"job{i}.out.json") for i in range(args.jobs)]
    pending, running = list(range(args.jobs)), {}
    while pending or running:
        while pending and len(running) < k:
            index = pending.pop(0)
            running[_forked(args, paths[index][0], str(paths[index][1]))] = index
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                index = running.pop(pid)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise RuntimeError(f"job {index} failed (exit status {status}; its traceback is above)")
        time.sleep(0.01)
    return [json.loads(out.read_text()) for _, out in paths]


def visible_gpus(args: argparse.Namespace) -> int:
    if args.fake_gpus:
        return args.fake_gpus
    import torch

    return torch.cuda.device_count()  # the driver opens no CUDA context: device_count reads the driver only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", help="evaluator_speed.py's SHAPES: 27b, mid, demo")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8], help="K: GPUs used at once")
    parser.add_argument("--jobs", type=int, default=8, help="evaluations per K")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tau", type=float, default=6.0)
    parser.add_argument("--fake-gpus", type=int, default=0, help="that many fake GPUs, evaluating on the CPU (tests)")
    parser.add_argument("--sample-s", type=float, default=0.5, help="nvidia-smi sampling interval")
    parser.add_argument(
        "--keep-records", type=Path, help="copy each K's claim records here (K<k>/), for `dflash-eval gpu-placements`"
    )
    parser.add_argument("--note", default="", help="a line for the record (the machine, its load)")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/multi_gpu_scaling.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the claim record of one evaluation job (internal)
    smoke_mode(
        parser,
        argv,
        shape="demo",
        dtype="float32",
        gpus=[1, 2],
        jobs=2,
        samples=1,
        seq_len=32,
        prompt_len=16,
        tau=3.0,
        fake_gpus=3,
        record=None,
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(evaluate_one(args, args.worker)), flush=True)
        return 0
    if args.fake_gpus:  # imported once here, before the jobs fork (dflash's model module loads lazily)
        import evaluator_speed  # noqa: F401
        from dflash import DFlashDraftModel  # noqa: F401
        from transformers.models.qwen3 import modeling_qwen3  # noqa: F401
    visible = visible_gpus(args)
    counts = [k for k in args.gpus if k <= visible]
    if not counts:
        raise SystemExit(f"no K in --gpus {args.gpus} fits the {visible} visible GPU(s)")
    lines = [
        f"## multi-GPU scaling: shape {args.shape}, {args.dtype}, {args.jobs} evaluations of {args.samples} "
        f"samples x {args.seq_len} tokens, {visible} {'fake ' if args.fake_gpus else ''}GPU(s) visible, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    if args.note:
        lines += [args.note, ""]
    lines += [
        "| K | jobs | wall s | speedup | efficiency | at once (max) | overlaps | job build s | job evaluate s "
        "| mean util % per GPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base: float | None = None
    failures = []
    for k in counts:
        with tempfile.TemporaryDirectory(prefix=f"scaling-k{k}-") as tmp:
            wall, outputs, sampler = run_jobs(args, k, Path(tmp))
            check = placement.check_placements(placement.read_records([Path(tmp)]))
            if args.keep_records:
                (args.keep_records / f"K{k}").mkdir(parents=True, exist_ok=True)
                for record in Path(tmp).glob(f"*{placement.SUFFIX}"):
                    shutil.copy2(record, args.keep_records / f"K{k}" / record.name)
        base = wall if k == 1 else base
        speedup = base / wall if base else None  # against one GPU: only where a K=1 row was run
        if not check.ok or check.peak != min(k, args.jobs):
            failures.append(f"K={k}: {check.peak} at once, overlaps {check.overlaps}, unfinished {check.unfinished}")
        utilisation = (
            " ".join(f"{index}:{value:.0f}" for index, value in sampler.mean_utilisation().items())
            or f"not sampled ({sampler.error})"
        )
        mean = lambda key: sum(o[key] for o in outputs) / len(outputs)  # noqa: E731
        ratio = f"{speedup:.2f} | {speedup / k:.2f}" if speedup else "- | -"
        lines.append(
            f"| {k} | {args.jobs} | {wall:.1f} | {ratio} | {check.peak} "
            f"| {len(check.overlaps)} | {mean('build_s'):.1f} | {mean('evaluate_s'):.1f} | {utilisation} |"
        )
    print_and_record(lines + [f"\nPLACEMENT FAILED {line}" for line in failures], args.record)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
