"""Where the trajectory evaluator's time goes: kernel time by kind against the wall, kernels and copies per round.

On the H200 a chain-B round was bound by what the host issues (the GPU ran kernels for ~65% of the wall), so
this prints what decides that: the wall of an unprofiled run, then from a profiled run the GPU's kernel time by
kind (matrix products, softmax, reductions, copies, the rest), the kernels launched and host-to-device copies
per round, and the host's time blocked in synchronisation. For the default method set it also times every round
on its own, bucketed by the blocks it computes (whether many small launch-bound rounds or the few large ones hold
the time), and the parts of a forward, each synchronised (layers, full blocks' scoring and its DDTree, the
chain-only head). The drafter and samples are evaluator_speed.py's (random 27B-shaped drafter, tokens built for
a chosen tau). Prints a table and appends it to benchmarks/results/round_profile.md (`--no-kernels` skips the
profiled run).

    python3 benchmarks/round_profile.py --shape 27b --tau 6 --samples 64 --sets chain-B default
    python benchmarks/round_profile.py --device cpu --shape demo --samples 8 --seq-len 512
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import evaluator_speed as bench  # benchmarks/ (the script's own folder)
import torch
from record import print_and_record, smoke_mode
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.trajectory import TrajectoryEvaluator

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


BUCKETS = [(0, 0), (1, 32), (33, 128), (129, 256), (257, 512), (513, 768), (769, 1 << 30)]  # blocks a round computes


def rounds_by_size(runner, samples, methods: dict, rows: int, config):
    """The evaluation's wall and counts, and each round's wall (a round ends in a read of the GPU's results, so its
    wall is its own) bucketed by the blocks it computed: (bucket, rounds, seconds, needed FLOPs). Shows whether
    many small, launch-bound rounds or the few large ones hold the time."""
    evaluator = TrajectoryEvaluator(runner, set(), blocks_per_forward=rows, head_split=4, **methods)
    inner = evaluator._round
    totals = {bucket: [0, 0.0, 0.0] for bucket in BUCKETS}

    def timed() -> None:
        blocks, sizes = evaluator.counts.blocks, dict(evaluator.counts.by_size)
        started = time.perf_counter()
        inner()
        seconds = time.perf_counter() - started
        done = evaluator.counts.blocks - blocks
        grown = {size: count - sizes.get(size, 0) for size, count in evaluator.counts.by_size.items()}
        bucket = next(b for b in BUCKETS if b[0] <= done <= b[1])
        totals[bucket][0] += 1
        totals[bucket][1] += seconds
        totals[bucket][2] += bench.needed_flops(config, grown)
    evaluator._round = timed
    wall, _ = bench.run_timed(evaluator, samples)
    return wall, evaluator.counts, [(f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}",
                                     *totals[(lo, hi)]) for lo, hi in BUCKETS]


def phases(runner, samples, methods: dict, rows: int) -> dict[str, float]:
    """Seconds in each part of a forward, each synchronised on both sides (so launch-bound parts lose their overlap
    with the host and read high): the drafter's layers, the full blocks' scoring (head, chain, DDTree, top-k), the
    chain-only blocks' head; the rest of the wall is the host's own bookkeeping."""
    from dflash_eval.evaluate import trajectory as module

    evaluator = TrajectoryEvaluator(runner, set(), blocks_per_forward=rows, head_split=4, **methods)
    spent: dict[str, float] = defaultdict(float)
    device = runner.embed.device

    def timed(label: str, inner):
        def wrapper(*args, **kwargs):
            bench.sync(device)
            started = time.perf_counter()
            out = inner(*args, **kwargs)
            bench.sync(device)
            spent[label] += time.perf_counter() - started
            return out
        return wrapper
    hidden, tree = module.packed_hidden, module.tree_accepted
    module.packed_hidden = timed("layers", hidden)
    module.tree_accepted = timed("  of which DDTree", tree)
    evaluator._full = timed("full blocks' scoring", evaluator._full)
    evaluator._chain_flat = timed("chain-only head", evaluator._chain_flat)
    try:
        spent["wall"], _ = bench.run_timed(evaluator, samples)
    finally:
        module.packed_hidden, module.tree_accepted = hidden, tree
    order = ["layers", "full blocks' scoring", "  of which DDTree", "chain-only head", "wall"]
    return {label: spent[label] for label in order}


def kernel_profile(runner, samples, methods: dict, rows: int, cuda: bool):
    """GPU kernel seconds by kind, kernel launches, host-to-device copies, seconds the host blocked, rounds."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _, _, counts, _ = bench.trajectory(runner, samples, methods, rows, 4)
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
    return by_kind, launches, copies, blocked, counts.rounds


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
    parser.add_argument("--no-kernels", action="store_true", help="skip the profiled run (the by-round table stays)")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/round_profile.md")
    smoke_mode(parser, device="cpu", shape="demo", samples=1, seq_len=32, rows=64, sets=["chain-B", "default"],
               record=None)
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
    by_round: list[str] = []
    for name in args.sets:
        methods = {} if name == "chain-B" else default
        bench.trajectory(runner, samples[:4], methods, args.rows, 4)  # warm
        if name == "chain-B":
            seconds, _, counts, _ = bench.trajectory(runner, samples, methods, args.rows, 4)
        else:  # each round timed on its own: the wall of the whole and its share by the size of a round
            seconds, counts, buckets = rounds_by_size(runner, samples, methods, args.rows, config)
            by_round.append(f"{name}, all {len(samples)} samples, rounds by the blocks they compute:")
            for bucket, count, spent, flops in buckets:
                share = f"{100 * flops / spent / (bench.PEAK_TFLOPS * 1e12):.1f}% of peak" if cuda and spent else "-"
                by_round.append(f"  {bucket:>8} blocks: {count:5d} rounds, {spent:7.2f} s ({100 * spent / seconds:4.1f}%),"
                                f" {1000 * spent / max(count, 1):6.2f} ms/round, {share}")
        peak = 100 * bench.needed_flops(config, counts.by_size) / seconds / (bench.PEAK_TFLOPS * 1e12) if cuda else None
        print(f"{name}: {seconds:.2f} s, {counts.rounds} rounds", flush=True)
        profiled = args.profiled_samples or (len(samples) if name == "chain-B" else max(1, len(samples) // 2))
        kinds = ["matmul", "softmax", "reduce/topk", "copy", "other"]
        cells = [name, str(len(samples)), f"{seconds:.2f}", str(counts.rounds), f"{1000 * seconds / counts.rounds:.1f}",
                 f"{peak:.1f}%" if peak is not None else "-"]
        if args.no_kernels:
            cells += ["-"] * 10
        else:
            by_kind, launches, copies, blocked, rounds = kernel_profile(runner, samples[:profiled], methods, args.rows,
                                                                        cuda)
            cells += [str(profiled), f"{sum(by_kind.values()):.2f}", *[f"{by_kind[k]:.2f}" for k in kinds],
                      f"{launches / rounds:.0f}", f"{copies / rounds:.1f}", f"{blocked:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        if name != "chain-B":
            spent = phases(runner, samples[:profiled], methods, args.rows)
            by_round.append(f"{name}, {profiled} samples, synchronised parts: "
                            + ", ".join(f"{label.strip()} {part:.2f} s" for label, part in spent.items()))
        print("\n".join(by_round), flush=True)
    lines += ["", "Kernel seconds are the profiled run's (its samples); the wall and % of peak are the unprofiled run's.",
              *by_round]
    print_and_record(lines, args.record)


if __name__ == "__main__":
    main()
