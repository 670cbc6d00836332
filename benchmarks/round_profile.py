"""Where the trajectory evaluator's time goes: kernel time by kind against the wall, kernels and copies per round.

On the H200 a chain-B round was bound by what the host issues (the GPU ran kernels for ~65% of the wall), so
this prints what decides that: the wall of an unprofiled run, then from a profiled run the GPU's kernel time by
kind (matrix products, softmax, reductions, copies, the rest), the kernels launched and host-to-device copies
per round, and the host's time blocked in synchronisation. The drafter and samples are evaluator_speed.py's
(random 27B-shaped drafter, tokens built for a chosen tau). Prints a table and appends it to
benchmarks/results/round_profile.md.

    python3 benchmarks/round_profile.py --shape 27b --tau 6 --samples 64 --sets chain-B default
    python benchmarks/round_profile.py --device cpu --shape demo --samples 8 --seq-len 512
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import evaluator_speed as bench  # benchmarks/ (the script's own folder)
import torch
from record import print_and_record
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash_eval.evaluate.blocks import BlockDrafter

ROOT = Path(__file__).resolve().parents[1]


def kernel_kind(name: str) -> str:
    low = name.lower()
    if any(mark in low for mark in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas")):
        return "matmul"
    if "softmax" in low:
        return "softmax"
    if "reduce" in low or "argmax" in low or "topk" in low or "sort" in low:
        return "reduce/topk"
    if "memcpy" in low or "memset" in low or "direct_copy" in low:
        return "copy"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="27b", choices=sorted(bench.SHAPES))
    parser.add_argument("--tau", type=float, default=6.0)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--profiled-samples", type=int, default=None, help="default: all (chain-B), half (default)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--sets", nargs="+", default=["chain-B"], choices=["chain-B", "default"])
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/round_profile.md")
    args = parser.parse_args()
    from dflash import DFlashDraftModel

    device, dtype = torch.device(args.device), torch.bfloat16
    config = bench.drafter_config(**bench.SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head *= torch.exp(1.5 * torch.randn(config.vocab_size, 1)).to(dtype)  # evaluator_speed's --head-spread
    runner = BlockDrafter(model, embed, head, config.dflash_config["mask_token_id"]).to(device)
    samples = bench.build_samples(runner, args.samples, args.seq_len, min(256, args.seq_len // 2), args.tau,
                                  seed=int(args.tau * 10))
    default = {"block_sizes": list(range(2, config.block_size + 1)), **bench.DEFAULT_METHODS}
    cuda = device.type == "cuda"
    lines = [f"## round profile: {torch.cuda.get_device_name(device) if cuda else 'CPU'}, bf16, shape {args.shape}, "
             f"tau {args.tau:g}, {args.rows} rows/forward, torch {torch.__version__}", "",
             "| methods | samples | wall s | rounds | ms/round | % of peak | profiled samples | kernel s | "
             "matmul | softmax | reduce/topk | copy | other | kernels/round | H2D copies/round | host blocked s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in args.sets:
        methods = {} if name == "chain-B" else default
        bench.trajectory(runner, samples[:4], methods, args.rows, 4)  # warm
        seconds, _, counts, _ = bench.trajectory(runner, samples, methods, args.rows, 4)
        peak = 100 * bench.needed_flops(config, counts.by_size) / seconds / (bench.PEAK_TFLOPS * 1e12) if cuda else None
        print(f"{name}: {seconds:.2f} s, {counts.rounds} rounds", flush=True)
        profiled = args.profiled_samples or (len(samples) if name == "chain-B" else len(samples) // 2)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            _, _, profiled_counts, _ = bench.trajectory(runner, samples[:profiled], methods, args.rows, 4)
        by_kind: dict[str, float] = defaultdict(float)
        launches = copies = blocked = 0.0
        for event in prof.key_averages():
            if event.device_type == DeviceType.CUDA and event.self_device_time_total > 0:
                by_kind[kernel_kind(event.key)] += event.self_device_time_total / 1e6
            elif event.key in ("cudaLaunchKernel", "cudaLaunchKernelExC"):
                launches += event.count
            elif event.key == "cudaMemcpyAsync":
                copies += event.count
            if event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync"):
                blocked += event.self_cpu_time_total / 1e6
        rounds = profiled_counts.rounds
        kinds = ["matmul", "softmax", "reduce/topk", "copy", "other"]
        lines.append("| " + " | ".join([
            name, str(len(samples)), f"{seconds:.2f}", str(counts.rounds), f"{1000 * seconds / counts.rounds:.1f}",
            f"{peak:.1f}%" if peak is not None else "-", str(profiled), f"{sum(by_kind.values()):.2f}",
            *[f"{by_kind[k]:.2f}" for k in kinds], f"{launches / rounds:.0f}", f"{copies / rounds:.1f}",
            f"{blocked:.2f}"]) + " |")
        print(lines[-1], flush=True)
    lines += ["", "Kernel seconds are the profiled run's (its samples); the wall and % of peak are the unprofiled run's."]
    print_and_record(lines, args.record)


if __name__ == "__main__":
    main()
