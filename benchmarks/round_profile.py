"""Where a trajectory evaluation's round goes on the GPU: kernel time by kind, host time by phase, idle time.

    python3 benchmarks/round_profile.py --shape 27b --tau 6 --samples 64
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import evaluator_speed as bench  # benchmarks/ (the script's own folder)
from dflash_eval.evaluate import packed, trajectory as traj_module
from dflash_eval.evaluate.blocks import BlockDrafter


LABELS = ("trajectory.", "pack", "packed_hidden", "attend")


def labelled(owner, name: str, label: str):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        with record_function(label):
            return inner(*args, **kwargs)
    setattr(owner, name, wrapper)


def kind(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas")):
        return "matmul"
    if "softmax" in low:
        return "softmax"
    if "reduce" in low or "argmax" in low or "max" in low:
        return "reduce"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "index" in low or "gather" in low or "scatter" in low or "cat" in low:
        return "index/cat"
    return "elementwise/other"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tau", type=float, default=6.0)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--sets", nargs="+", default=["chain-B"])
    parser.add_argument("--variants", nargs="+", default=["split4"])
    args = parser.parse_args()
    from dflash import DFlashDraftModel
    device, dtype = torch.device(args.device), torch.bfloat16
    config = bench.drafter_config(**bench.SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head *= torch.exp(1.5 * torch.randn(config.vocab_size, 1)).to(dtype)
    runner = BlockDrafter(model, embed, head, config.dflash_config["mask_token_id"]).to(device)
    started = time.perf_counter()
    samples = bench.build_samples(runner, args.samples, args.seq_len, 256, args.tau, seed=int(args.tau * 10))
    print(f"samples built in {time.perf_counter() - started:.1f} s", flush=True)
    default = {"block_sizes": list(range(2, config.block_size + 1)), **bench.DEFAULT_METHODS}
    for name in ("_round", "_compute", "_full", "_chain_flat", "_chain"):
        labelled(traj_module.TrajectoryEvaluator, name, f"trajectory.{name}")
    labelled(traj_module, "pack", "pack")
    labelled(traj_module, "packed_hidden", "packed_hidden")
    labelled(packed, "_attend", "attend")
    for set_name in args.sets:
        methods = {} if set_name == "chain-B" else default
        for variant in args.variants:
            split = None if variant == "whole" else int(variant.removeprefix("split"))
            bench.trajectory(runner, samples[:4], methods, args.rows, split)  # warm
            seconds, tokens, counts, steps = bench.trajectory(runner, samples, methods, args.rows, split)
            flops = bench.needed_flops(config, counts.by_size)
            print(f"{set_name} {variant}: {seconds:.2f} s, {counts.rounds} rounds ({1000 * seconds / counts.rounds:.2f} ms"
                  f" each), {counts.forwards} forwards, tau {bench.chain_tau(steps, config.block_size):.2f}, "
                  f"{100 * flops / seconds / 790e12:.1f}% of peak", flush=True)
            sub = samples[:args.samples // 2] if set_name != "chain-B" else samples
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
                wall = time.perf_counter()
                p_seconds, _, p_counts, _ = bench.trajectory(runner, sub, methods, args.rows, split)
                wall = time.perf_counter() - wall
            events = prof.key_averages()
            gpu = defaultdict(float)
            kernels = []
            for e in events:
                t = e.self_device_time_total
                if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith(LABELS):
                    gpu[kind(e.key)] += t
                    kernels.append((t, e.count, e.key))
            busy = sum(gpu.values()) / 1e6
            print(f"  profiled: wall {wall:.2f} s, GPU kernels {busy:.2f} s ({100 * busy / wall:.0f}% busy), "
                  f"{p_counts.rounds} rounds", flush=True)
            for k, t in sorted(gpu.items(), key=lambda x: -x[1]):
                print(f"    gpu {k:20s} {t / 1e6:7.3f} s  {100 * t / 1e6 / wall:5.1f}% of wall")
            for t, c, key in sorted(kernels, reverse=True)[:14]:
                print(f"    kernel {t / 1e3:9.1f} ms  x{c:6d}  {key[:110]}")
            host = {e.key: (e.cpu_time_total, e.self_cpu_time_total, e.count) for e in events
                    if e.key.startswith(("trajectory.", "pack", "attend")) or e.key.startswith("cuda")
                    or e.key in ("aten::item", "aten::_local_scalar_dense", "aten::copy_", "aten::nonzero",
                                 "aten::to", "aten::_to_copy")}
            for key, (total, own, count) in sorted(host.items(), key=lambda x: -x[1][0]):
                print(f"    host {key:36s} total {total / 1e6:7.3f} s  self {own / 1e6:7.3f} s  x{count}")
            ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten")),
                         key=lambda e: -e.self_cpu_time_total)[:12]
            for e in ops:
                print(f"    op {e.key:34s} self {e.self_cpu_time_total / 1e6:7.3f} s  x{e.count}")


if __name__ == "__main__":
    main()
