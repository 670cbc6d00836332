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
import signal
import time
from collections import defaultdict
from pathlib import Path

import evaluator_speed as bench  # benchmarks/ (the script's own folder)
import torch
from record import print_and_record, smoke_mode
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.cuda_graphs import ROUTES
from dflash_eval.evaluate.trajectory import EvaluatorOptions, TrajectoryEvaluator

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
    evaluator = TrajectoryEvaluator(
        runner, set(), options=EvaluatorOptions(blocks_per_forward=rows, head_split=4), **methods
    )
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
    return (
        wall,
        evaluator.counts,
        [
            (f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}", *totals[(lo, hi)])
            for lo, hi in BUCKETS
        ],
    )


def attention_flops(attn, hidden: torch.Tensor, batch) -> tuple[float, float]:
    """The needed FLOPs of one layer's attention call: its four projections over the real tokens, and the scores
    and weighted values (4 * head_dim per query head per key) over the keys each real query sees: its context
    (the anchor's positions; the sliding window, at least the samples' length here, hides none) and its own
    block (all of it, or up to itself where the layer is causal). Padding in the explicit products is not needed
    work and is not counted."""
    n, width = hidden.shape
    q, kv = attn.q_proj.out_features, attn.k_proj.out_features
    projections = 2.0 * n * (width * q + 2 * width * kv + q * width)
    real = batch.query_row >= 0
    own = torch.bincount(batch.query_row[real]).to(torch.float64)  # each block's length
    own_keys = (own * (own + 1) / 2 if attn.is_causal else own * own).sum()
    keys = float(batch.query_anchor[real].sum().item() + own_keys.item())
    return projections, 4.0 * q * keys


PARTS = [
    "drafter attention: projections",
    "drafter attention: scores",
    "drafter MLP, norms, embedding",
    "LM head",
    "DDTree tree build + score",
    "chain accept, top-k, the round's read-back",
    "host: the round's bookkeeping, packing, copies",
]


def phases(runner, samples, methods: dict, rows: int, config) -> tuple[dict[str, float], dict[str, float], float]:
    """Seconds and needed FLOPs of each part of the evaluation (PARTS), each part synchronised on both sides (so a
    launch-bound part loses its overlap with the host and reads high), and the wall of the synchronised run.
    The attention's projections and scores are one call per layer: its seconds are split by their FLOPs' share at
    the same rate, an estimate marked in the table; every other part is measured."""
    from dflash_eval.evaluate import packed
    from dflash_eval.evaluate import trajectory as module

    evaluator = TrajectoryEvaluator(
        runner, set(), options=EvaluatorOptions(blocks_per_forward=rows, head_split=4), **methods
    )
    spent: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    device = runner.embed.device

    def clocked(label: str, inner, count=None):
        def wrapper(*args, **kwargs):
            bench.sync(device)
            started = time.perf_counter()
            out = inner(*args, **kwargs)
            bench.sync(device)
            spent[label] += time.perf_counter() - started
            if count is not None:
                count(*args, **kwargs)
            return out

        return wrapper

    def count_layers(drafter, pool, batch, *rest, **named) -> None:
        n = batch.token_ids.shape[0]
        flops["layers"] += n * bench.layer_flops_per_token(config)

    def count_attention(drafter, attn, hidden, keys, values, batch, *rest) -> None:
        projections, scores = attention_flops(attn, hidden, batch)
        flops["drafter attention: projections"] += projections
        flops["drafter attention: scores"] += scores

    def count_head(states) -> None:
        flops["LM head"] += 2.0 * states.numel() * config.vocab_size

    saved = module.packed_hidden, module.tree_accepted, packed._attention
    module.packed_hidden = clocked("layers", saved[0], count_layers)
    module.tree_accepted = clocked("DDTree tree build + score", saved[1])
    packed._attention = clocked("attention", saved[2], count_attention)
    runner.head_logits = clocked("LM head", runner.head_logits, count_head)
    evaluator._forward = clocked("forward", evaluator._forward)
    try:
        wall, _ = bench.run_timed(evaluator, samples)
    finally:
        module.packed_hidden, module.tree_accepted, packed._attention = saved
        del runner.head_logits
    attention_flops_all = flops["drafter attention: projections"] + flops["drafter attention: scores"]
    share = flops["drafter attention: projections"] / max(attention_flops_all, 1.0)
    seconds = {
        PARTS[0]: spent["attention"] * share,
        PARTS[1]: spent["attention"] * (1 - share),
        PARTS[2]: spent["layers"] - spent["attention"],
        PARTS[3]: spent["LM head"],
        PARTS[4]: spent[PARTS[4]],
        PARTS[5]: spent["forward"] - spent["layers"] - spent["LM head"] - spent[PARTS[4]],
        PARTS[6]: wall - spent["forward"],
    }
    needed = {
        PARTS[0]: flops[PARTS[0]],
        PARTS[1]: flops[PARTS[1]],
        PARTS[2]: flops["layers"] - flops[PARTS[0]],
        PARTS[3]: flops["LM head"],
    }
    return seconds, needed, wall


def parts_table(
    name: str, seconds: dict[str, float], needed: dict[str, float], wall: float, peak: float | None, samples: int
) -> list[str]:
    """The parts as a table, and what 2x would take: the wall if each matrix part ran at the peak (the others
    as measured), and the time the parts without matrix work hold on their own."""
    lines = [
        f"{name}, {samples} samples, each part synchronised (wall {wall:.2f} s; % of peak against "
        f"{bench.PEAK_TFLOPS:g} TFLOP/s, the measured H200 bf16 matrix rate, not the 989 of the spec):",
        "",
        "| part | s | % of wall | needed TFLOP | % of peak |",
        "|---|---:|---:|---:|---:|",
    ]
    for part in PARTS:
        cost = needed.get(part)
        rate = f"{100 * cost / seconds[part] / (peak * 1e12):.1f}%" if cost and peak and seconds[part] > 0 else "-"
        label = part + (" (split of one call by FLOPs)" if part in PARTS[:2] else "")
        lines.append(
            f"| {label} | {seconds[part]:.2f} | {100 * seconds[part] / wall:.1f}% | {cost / 1e12:.2f} |"
            if cost is not None
            else f"| {label} | {seconds[part]:.2f} | {100 * seconds[part] / wall:.1f}% | - |"
        )
        lines[-1] += f" {rate} |"
    if peak:
        matrix = sum(needed.values()) / (peak * 1e12)
        other = sum(seconds[p] for p in PARTS if p not in needed)
        at_peak = other + matrix
        lines += [
            "",
            f"If every matrix part ran at 100% of peak and the rest as measured: {at_peak:.2f} s, "
            f"{wall / at_peak:.2f}x this wall; at 60%: {other + matrix / 0.6:.2f} s, "
            f"{wall / (other + matrix / 0.6):.2f}x. The parts without matrix work (DDTree, accept and "
            f"read-back, host) hold {other:.2f} s ({100 * other / wall:.1f}%): 2x needs them and the matrix "
            f"parts together within {wall / 2:.2f} s.",
        ]
    return lines


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


def shape_census(runner, samples, methods: dict, rows: int, cap: int) -> tuple[int, int, int]:
    """(forwards, forwards of at most `cap` flat tokens, distinct eager shapes among them): an eager forward's
    shapes are its flat tokens, attention groups, queries and context keys per group; a graph captured at exactly
    those shapes would run the eager kernels, so this is how many graphs an exact-shape route needs."""
    from dflash_eval.evaluate import packed
    from dflash_eval.evaluate import trajectory as module

    shapes: list[tuple] = []
    inner = module.pack

    def recorded(slot, anchor, size, tokens, mask, device, groups="slot"):
        _, facts = packed.pack_arrays(slot, anchor, size, tokens, mask, groups)
        shapes.append(
            (
                int(size.sum()),
                facts["ctx_len"],
                tuple(facts["group_ctx"].tolist()),
                tuple(facts["group_queries"].tolist()),
            )
        )
        return inner(slot, anchor, size, tokens, mask, device, groups)

    module.pack = recorded
    try:
        bench.trajectory(runner, samples, methods, rows, 4)
    finally:
        module.pack = inner
    small = [shape for shape in shapes if shape[0] <= cap]
    return len(shapes), len(small), len(set(small))


def graph_check(runner, samples, methods: dict, rows: int, tokens: list[int], max_graphs: int) -> list[str]:
    """Eager against CUDA graphs padded to size classes (today's lever) and graphs at each round's own flat token
    count (the GEMMs over the eager rows; the attention still padded): wall, equal trajectories, graphs."""
    eager_s, _, _, expected = bench.trajectory(runner, samples, methods, rows, 4)
    lines = [f"| eager | {eager_s:.2f} | 1.00x | 100% | - | - |"]
    for label, lever in [
        (f"graphs padded to {tokens}", {"cuda_graph_tokens": tokens}),
        (
            f"graphs at each round's tokens (<= {max(tokens)}, at most {max_graphs})",
            {"cuda_graph_tokens": [max(tokens)], "graph_exact_tokens": True, "max_graphs": max_graphs},
        ),
    ]:
        seconds, _, counts, steps = bench.trajectory(runner, samples, methods, rows, 4, lever=lever)
        equal = bench.agreement(expected, steps)
        lines.append(
            f"| {label} | {seconds:.2f} | {eager_s / seconds:.2f}x | {100 * equal:.1f}% | "
            f"{counts.graph_replays} of {counts.forwards} ({counts.graphs} graphs) | "
            f"{counts.graph_capture_seconds:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="27b", choices=sorted(bench.SHAPES))
    parser.add_argument("--taus", type=float, nargs="+", default=[6.0], help="in this order (the first matters most)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--profiled-samples", type=int, default=None, help="default: all (chain-B), half (default)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--sets", nargs="+", default=["chain-B"], choices=["chain-B", "default"])
    parser.add_argument("--no-kernels", action="store_true", help="skip the profiled run (the by-round table stays)")
    parser.add_argument(
        "--graph-check",
        action="store_true",
        help="after the first tau: eager against both CUDA graph routes, bf16 steps and speed",
    )
    parser.add_argument("--graph-samples", type=int, default=None, help="samples of the graph check (default: all)")
    parser.add_argument(
        "--graph-tokens",
        type=int,
        nargs="+",
        default=ROUTES["padded"]["cuda_graph_tokens"],
        help="size classes of the padded route; the largest also bounds the per-round route",
    )
    parser.add_argument("--max-graphs", type=int, default=ROUTES["round_tokens"]["max_graphs"])
    parser.add_argument("--time-cap", type=float, default=None, help="seconds: no new tau, set or check past it")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/round_profile.md")
    smoke_mode(
        parser,
        argv,
        device="cpu",
        shape="demo",
        samples=1,
        seq_len=32,
        rows=64,
        sets=["chain-B", "default"],
        record=None,
        graph_tokens=[64, 256],
        max_graphs=4,
        graph_check=True,
    )
    args = parser.parse_args(argv)
    from dflash import DFlashDraftModel

    began = time.perf_counter()

    def out_of_time() -> bool:
        return args.time_cap is not None and time.perf_counter() - began > args.time_cap

    device, dtype = torch.device(args.device), torch.bfloat16
    config = bench.drafter_config(**bench.SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        head *= torch.exp(1.5 * torch.randn(config.vocab_size, 1)).to(dtype)  # evaluator_speed's --head-spread
    runner = BlockDrafter(model, embed, head, config.dflash_config["mask_token_id"]).to(device)
    default = {"block_sizes": list(range(2, config.block_size + 1)), **bench.DEFAULT_METHODS}
    cuda = device.type == "cuda"
    peak = bench.PEAK_TFLOPS if cuda else None
    lines = [
        f"## round profile: {torch.cuda.get_device_name(device) if cuda else 'CPU'}, bf16, shape {args.shape}, "
        f"{args.samples} samples of {args.seq_len} tokens, {args.rows} rows/forward, torch {torch.__version__}",
        "",
        "| tau | methods | samples | wall s | rounds | ms/round | % of peak | launch-bound share "
        "(rounds <= 256 blocks) | profiled samples | kernel s | matmul | softmax | reduce/topk | copy | other | "
        "kernels/round | H2D copies/round | host blocked s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("| methods | samples | wall s | (the columns of the table below)", flush=True)
    details: list[str] = []

    def stop(signum, frame) -> None:  # a `timeout` kill: unwind, so that the finally below records what was measured
        raise SystemExit(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:  # what was measured is recorded even if a later tau fails or the call is cut
        for index, tau in enumerate(args.taus):
            if out_of_time():
                details.append(f"(tau {tau:g} and later: not run, past --time-cap {args.time_cap:g} s)")
                break
            samples = bench.build_samples(
                runner, args.samples, args.seq_len, min(256, args.seq_len // 2), tau, seed=int(tau * 10)
            )
            for name in args.sets:
                if out_of_time():
                    details.append(f"(tau {tau:g}, {name}: not run, past --time-cap)")
                    break
                methods = {} if name == "chain-B" else default
                bench.trajectory(runner, samples[:2], methods, args.rows, 4)  # warm
                seconds, counts, buckets = rounds_by_size(runner, samples, methods, args.rows, config)
                details += ["", f"tau {tau:g}, {name}, all {len(samples)} samples, rounds by the blocks they compute:"]
                for bucket, count, spent, flops in buckets:
                    share = f"{100 * flops / spent / (peak * 1e12):.1f}% of peak" if peak and spent else "-"
                    details.append(
                        f"  {bucket:>8} blocks: {count:5d} rounds, {spent:7.2f} s "
                        f"({100 * spent / seconds:4.1f}%), {1000 * spent / max(count, 1):6.2f} ms/round, {share}"
                    )
                launch_bound = sum(spent for (bucket, _, spent, _), (lo, hi) in zip(buckets, BUCKETS) if hi <= 256)
                rate = 100 * bench.needed_flops(config, counts.by_size) / seconds / (peak * 1e12) if peak else None
                profiled = args.profiled_samples or (len(samples) if name == "chain-B" else max(1, len(samples) // 2))
                kinds = ["matmul", "softmax", "reduce/topk", "copy", "other"]
                cells = [
                    f"{tau:g}",
                    name,
                    str(len(samples)),
                    f"{seconds:.2f}",
                    str(counts.rounds),
                    f"{1000 * seconds / counts.rounds:.1f}",
                    f"{rate:.1f}%" if rate is not None else "-",
                    f"{100 * launch_bound / seconds:.1f}%",
                ]
                if args.no_kernels:
                    cells += ["-"] * 10
                else:
                    by_kind, launches, copies, blocked, rounds = kernel_profile(
                        runner, samples[:profiled], methods, args.rows, cuda
                    )
                    cells += [
                        str(profiled),
                        f"{sum(by_kind.values()):.2f}",
                        *[f"{by_kind[k]:.2f}" for k in kinds],
                        f"{launches / rounds:.0f}",
                        f"{copies / rounds:.1f}",
                        f"{blocked:.2f}",
                    ]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
                part_s, needed, wall = phases(runner, samples[:profiled], methods, args.rows, config)
                details += [""] + parts_table(f"tau {tau:g}, {name}", part_s, needed, wall, peak, profiled)
                print("\n".join(details[-14:]), flush=True)
            if index == 0 and args.graph_check and not out_of_time():
                details += [
                    "",
                    f"tau {tau:g}: CUDA graphs against eager, bf16 (equal: trajectories whose steps are the "
                    "eager evaluator's)",
                    "",
                ]
                for name in args.sets:
                    if out_of_time():
                        details.append(f"({name}: not run, past --time-cap)")
                        break
                    methods = {} if name == "chain-B" else default
                    chosen = samples[: args.graph_samples or len(samples)]
                    forwards, small, distinct = shape_census(runner, chosen, methods, args.rows, max(args.graph_tokens))
                    details += [
                        f"{name}, {len(chosen)} samples: {forwards} forwards, {small} of at most "
                        f"{max(args.graph_tokens)} tokens, {distinct} distinct exact eager shapes among those "
                        f"(graphs an exact-shape route would capture: {small / max(distinct, 1):.2f} replays each)",
                        "",
                        "| route | wall s | x eager | equal trajectories | forwards replayed | capture s |",
                        "|---|---:|---:|---:|---|---:|",
                    ]
                    details += graph_check(runner, chosen, methods, args.rows, args.graph_tokens, args.max_graphs)
                    details.append("")
    finally:
        signal.signal(signal.SIGTERM, previous)
        lines += [
            "",
            "Kernel seconds are the profiled run's (its samples); the wall, % of peak and the launch-bound "
            "share are the unprofiled run's (each round timed; a round ends in a read of its results).",
            *details,
        ]
        print_and_record(lines, args.record)


if __name__ == "__main__":
    main()
