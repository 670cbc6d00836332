"""Does the target's step profile repeat? tools/target_timing.py measured twice in one process and once in each of two
fresh processes, per verified size: the two medians and their ratio (the issue's bar: within 5%).

Random weights, batch 1, a cache prefilled with `--context` tokens, the shapes of benchmarks/speedup_validation.py
(`8b`: pure attention, timed as `graphs` on CUDA: a static cache and one CUDA graph per size; `27b`: a Gated
DeltaNet hybrid, timed as `graphs` too, over static GDN states with extraction's kernels; each size synchronised
repeats until the median's 95% CI is within ±2% or a cap).
A fresh process rebuilds the same model from the same seed: it repeats what a second extraction of the same target
would see (a new allocator, new kernel selection, new clocks). `--max-seconds` starts no new shape past it.

    python benchmarks/profile_repeatability.py --device cuda --shapes 8b,27b --record $OUT/profile_repeatability.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

ROOT = Path(__file__).resolve().parents[1]
AGREE = 0.05  # speedup/timing.py's AGREEMENT, the bar


def build_target(name: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from speedup_validation import SHAPES, target_config
    from transformers import AutoModelForCausalLM

    shape = SHAPES[name]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return AutoModelForCausalLM.from_config(target_config(shape, layers or shape["layers"])).eval()
    finally:
        torch.set_default_dtype(previous)


def measure(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    from dflash_eval.tools.target_timing import measure_target

    return measure_target(
        model,
        args.context,
        args.repeats,
        args.sizes,
        seconds_per_size=args.seconds_per_size,
        total_seconds=args.total_seconds,
    )


def setup(device: torch.device) -> torch.dtype:
    """The backend bound explicitly (fla on CUDA, torch elsewhere), and the dtype (bf16 on CUDA, fp32 on a CPU)."""
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  loaded, so that the binding reaches it

    from dflash_eval.extract.backends import bind_backend

    bind_backend("fla" if device.type == "cuda" else "torch", device)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def child_args(args: argparse.Namespace, shape: str, out: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        shape,
        "--out",
        str(out),
        "--device",
        args.device,
        "--context",
        str(args.context),
        "--repeats",
        str(args.repeats),
        "--sizes",
        ",".join(map(str, args.sizes)),
        "--seconds-per-size",
        str(args.seconds_per_size),
        "--total-seconds",
        str(args.total_seconds),
        *(["--layers", str(args.layers)] if args.layers else []),
    ]


def in_processes(args: argparse.Namespace, shape: str) -> list[dict]:
    """One profile in each of two fresh processes, one after the other."""
    profiles = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(2):
            out = Path(folder) / f"profile{i}.json"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run(child_args(args, shape, out), env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"profile process {i + 1} failed: {done.stderr[-2000:]}")
            profiles.append(json.loads(out.read_text()))
    return profiles


def cell(profile: dict, n: str) -> str:
    capped = " (capped)" if int(n) in profile["spread"]["unstable"] else ""
    return f"{profile['t_verify_ms'][n]:.3f}{capped}"


def shape_lines(shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    began = time.perf_counter()
    model = build_target(shape, args.layers, device, dtype)
    same = [measure(model, args) for _ in range(2)]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fresh = in_processes(args, shape)
    first = same[0]
    lines = [
        "",
        f"### {shape}: profile method `{first['method']}` ({first['method_why']}), context {args.context}, "
        f"{args.repeats} repeats at least, cap {args.seconds_per_size:g} s per size and {args.total_seconds:g} s "
        f"per profile; profile wall s: in one process {same[0]['wall_s']:.1f} and {same[1]['wall_s']:.1f}, "
        f"in two processes {fresh[0]['wall_s']:.1f} and {fresh[1]['wall_s']:.1f}; shape done in "
        f"{time.perf_counter() - began:.0f} s",
        "",
        "| tokens verified | one process: run 1 ms | run 2 ms | run 2 / run 1 | two processes: process 1 ms | "
        "process 2 ms | process 2 / process 1 | process 1 / run 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    beyond = {"one process": [], "two processes": [], "across": []}
    for n in first["t_verify_ms"]:
        a, b = same[0]["t_verify_ms"][n], same[1]["t_verify_ms"][n]
        c, d = fresh[0]["t_verify_ms"][n], fresh[1]["t_verify_ms"][n]
        for what, ratio in (("one process", b / a), ("two processes", d / c), ("across", c / a)):
            if abs(ratio - 1) > AGREE:
                beyond[what].append(n)
        lines.append(
            f"| {n} | {cell(same[0], n)} | {cell(same[1], n)} | {b / a:.3f} | {cell(fresh[0], n)} | "
            f"{cell(fresh[1], n)} | {d / c:.3f} | {c / a:.3f} |"
        )
    sizes = len(first["t_verify_ms"])
    lines += [
        "",
        "; ".join(
            f"{what}: {sizes - len(apart)} of {sizes} sizes within 5% (beyond: {', '.join(apart) or 'none'})"
            for what, apart in beyond.items()
        ),
    ]
    return lines


def child(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = setup(device)
    profile = measure(build_target(args.child, args.layers, device, dtype), args)
    args.out.write_text(json.dumps(profile))
    return 0


def main(argv: list[str] | None = None) -> int:
    from speedup_validation import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="8b,27b", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    parser.add_argument("--context", type=int, default=288)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2, 4, 8, 9, 16, 17, 33, 65, 257],
        help="tokens verified (chain blocks, DDTree N + 1), comma-separated",
    )
    parser.add_argument("--seconds-per-size", type=float, default=2.0)
    parser.add_argument("--total-seconds", type=float, default=20.0, help="the cap on one profile's repeats")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="start no new shape past this")
    parser.add_argument(
        "--record", type=Path, default=ROOT / "benchmarks/results" / "profile_repeatability.md"
    )  # written by its first run
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a fresh process: measure SHAPE once
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    smoke_mode(
        parser,
        argv,
        device="cpu",
        shapes="tiny-attention",
        context=16,
        repeats=2,
        sizes=[1, 2, 5],
        seconds_per_size=0.1,
        total_seconds=1.0,
        record=None,
    )
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    device = torch.device(args.device)
    dtype = setup(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    began = time.perf_counter()
    print_and_record(
        [
            f"## profile_repeatability {time.strftime('%Y-%m-%d')}: {name}, torch {torch.__version__}, "
            f"{dtype}, batch 1; each shape's profile twice in one process, then once in each of two "
            "fresh processes"
        ],
        args.record,
    )
    skipped = []
    for shape in args.shapes.split(","):
        if time.perf_counter() - began > args.max_seconds:
            skipped.append(shape)
            continue
        print_and_record(shape_lines(shape, args, device, dtype), args.record)
    print_and_record(
        [
            "",
            f"wall {time.perf_counter() - began:.0f} s; not measured (past --max-seconds "
            f"{args.max_seconds:g}): {', '.join(skipped) or 'none'}",
        ],
        args.record,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
