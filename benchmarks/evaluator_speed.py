"""Time to result of the trajectory evaluator, the all-anchor evaluator and the reference loop, side by side.

Drafters of a given shape with random weights (27b: Qwen3.6-27B-DFlash, 5 layers, hidden 5120, 32/8
heads of 128, intermediate 17408, block 16, vocab 248320, 4 sliding-window layers of 2048 + 1 full;
mid and demo: smaller shapes for CPUs), random cached features, and token sequences built so that
the drafter's own drafts are accepted at a chosen rate (dflash_eval/testing/accepted.py: at the anchor the
chain reaches, keep the draft's first a tokens, a = leading successes of a per-position acceptance q
solved for the tau asked, then a token that differs from the draft: half the time the drafter's
second choice there, so that DDTree accepts more than the chain). The drafter's full-attention layer
runs causally here (the same FLOPs), so that a block of b drafts the first b - 1 tokens of a block of
B and every chain size has a realistic acceptance, not tau 1. The LM head's rows get log-normal norms
(`--head-spread`, the sigma of their log): with equal norms a random head's top two logits over a
large vocabulary often lie within one bf16 step of each other, so a bf16 forward whose batch differs
(which blocks share it) flips drafts that the data's construction accepted, and the measured tau falls
below the one asked for (3.7 for 6 on the H200 with equal norms); with spread norms the best tokens
stand apart, as in a trained drafter. On 1 CPU thread (mid shape, bf16) the spread 1 raised the share of
trajectories equal to the all-anchor evaluator's from 50% to 100% (chain-B) and from 80% to 97% (the
default set); on the H200 (vocab 248,320) they still differ, and chain-B's tau moves with the batch:
5.96 alone, 5.23 among the default set's blocks (benchmarks/results/evaluator_speed.md).

Rows, per tau and method set ("chain-B": the drafter's own chain alone; "default": chain 2..B,
DDTree 8/16/32/64 and top-k 1/4/16, the stage's defaults):
- all-anchor: anchors.evaluate_sample per sample (the evaluator before the trajectory one);
- trajectory: trajectory.TrajectoryEvaluator over all samples (the stage's evaluator);
- with --speed-levers, after today's code (the first row), CUDA graphs for forwards of at most
  max(--cuda-graph-tokens) tokens (EvaluatorOptions, exact by construction); its steps are compared with today's;
  --fp32-samples repeats that comparison in fp32 at the first tau (the exactness rule); the set "ddtree-1024"
  (budgets 8..1024) against "default" gives the cost of large budgets. The levers measured and rejected (flex
  attention, lookahead, the DDTree scorer with host reads) are gone from the evaluator (git and
  benchmarks/results/evaluator_speed.md keep them);
  --time-cap starts no row after that many seconds, so a bounded call still records what it measured;
- with --compare-attention, the same with each attention forced: the explicit products alone, and on CUDA
  the fused kernel in every forward (the device's choice mixes them by queries per sample: packed.py);
- reference loop (chain-B only): `dflash_generate`'s draft phase, batch 1, its KV cache, the host
  reading the acceptance each step, following its own chain; as published (the LM head on the
  strided slice) and with a contiguous head (the best version of it); warm. Its time to result is
  its measured cost per step times the steps of the answer (the evaluator's chain-B steps): on a
  random drafter two logits often nearly tie, and the loop's own bf16 rounding then rejects drafts
  that the evaluators (and the data's construction) accept.
Time to result = completion tokens evaluated per second. Needed work = the FLOPs of the distinct
blocks the answer needs (each visited anchor's block: the layers' matrix products over its tokens,
the LM head over its draft positions; attention scores not counted): of each trajectory row's own
answer (in bf16 two variants can take different steps), of the first trajectory row's for the others; % of
peak = needed work / (seconds x the bf16 matrix peak). Blocks per token: drafter blocks computed per
completion token. Prints a table and appends it to benchmarks/results/evaluator_speed.md.

    python3 benchmarks/evaluator_speed.py --device cuda --shape 27b
    python benchmarks/evaluator_speed.py --device cpu --shape demo --taus 3 6 --samples 16 --seq-len 256 --prompt-len 64
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)
from transformers import Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
from dflash_eval.evaluate import packed
from dflash_eval.evaluate.acceptance import SequenceLimits
from dflash_eval.evaluate.all_anchor import evaluate_sample
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.packed import fused_attention_for
from dflash_eval.evaluate.trajectory import (
    EvaluatorOptions,
    LoadedSample,
    SampleSpec,
    TrajectoryEvaluator,
)
from dflash_eval.methods import chain_method
from dflash_eval.testing.accepted import accepted_tokens

PEAK_TFLOPS = 790.0  # bf16 dense matrix rate measured on one H200
SHAPES = {
    "27b": dict(
        layers=5,
        hidden=5120,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=17408,
        block=16,
        vocab=248320,
        window=2048,
        num_target_layers=64,
    ),
    "mid": dict(
        layers=3,
        hidden=1024,
        heads=16,
        kv_heads=4,
        head_dim=64,
        intermediate=3072,
        block=16,
        vocab=32000,
        window=512,
        num_target_layers=28,
    ),
    "demo": dict(
        layers=2,
        hidden=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=256,
        block=8,
        vocab=4096,
        window=64,
        num_target_layers=8,
    ),
}
DEFAULT_METHODS = {"budgets": [8, 16, 32, 64], "topk": [1, 4, 16]}
LEVER_LABELS = {"cuda_graph_tokens": "CUDA graphs"}
LARGE_BUDGETS = [8, 16, 32, 64, 128, 256, 512, 1024]  # the "ddtree-1024" set: the default set with budgets to 1024


def lever_label(lever: dict) -> str:
    """A row's lever options in words (the keys LEVER_LABELS names; the graph options' details are not)."""
    return "".join(f", {LEVER_LABELS[key]}" for key in lever if key in LEVER_LABELS)


def drafter_config(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    block: int,
    vocab: int,
    window: int,
    num_target_layers: int,
) -> Qwen3Config:
    ids = [round(1 + i * (num_target_layers - 4) / (layers - 1)) for i in range(layers)]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=40960,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        block_size=block,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": vocab - 250, "target_layer_ids": ids},
        rope_theta=10_000_000.0,
    )
    config.is_causal = True  # see the docstring: realistic acceptance for every chain block size
    return config


def layer_flops_per_token(config: Qwen3Config) -> float:
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, i = config.num_key_value_heads * config.head_dim, config.intermediate_size
    return 2.0 * (h * q + 2 * h * kv + q * h + 3 * h * i) * config.num_hidden_layers


def needed_flops(config: Qwen3Config, by_size: dict[int, int]) -> float:
    """FLOPs of the distinct blocks the answer needs, from their counts by block length."""
    head = 2.0 * config.hidden_size * config.vocab_size
    return sum(count * (layer_flops_per_token(config) * size + head * (size - 1)) for size, count in by_size.items())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_samples(runner: BlockDrafter, count: int, seq_len: int, prompt_len: int, tau: float, seed: int):
    generator = torch.Generator(device=runner.embed.device).manual_seed(seed)
    width = runner.drafter.fc.in_features
    features = [
        torch.randn(seq_len, width, device=runner.embed.device, generator=generator).to(runner.embed.dtype)
        for _ in range(count)
    ]
    low, high = 8, runner.embed.shape[0] - 300  # free tokens away from the mask token
    tokens = accepted_tokens(runner, features, [prompt_len] * count, tau, seed=seed, vocab=(low, high), alternative=0.5)
    limits = SequenceLimits(prompt_len, seq_len, seq_len)
    return [(f, t, limits) for f, t in zip(features, tokens)]


def all_anchor(runner, samples, methods: dict, chunk: int) -> tuple[float, int, dict]:
    sync(runner.embed.device)
    started = time.perf_counter()
    steps = {}
    for index, (features, tokens, limits) in enumerate(samples):
        steps[str(index)] = evaluate_sample(runner, features, tokens, limits, set(), chunk=chunk, **methods).steps
    sync(runner.embed.device)
    return time.perf_counter() - started, completion_tokens(samples), steps


def run_timed(evaluator: TrajectoryEvaluator, samples) -> tuple[float, dict]:
    """Seconds of a whole evaluation of `samples` (features, tokens, limits), synchronised, and its results."""
    specs = [
        SampleSpec(str(i), len(t), lambda f=f, t=t, lim=lim: LoadedSample(f, t, lim))
        for i, (f, t, lim) in enumerate(samples)
    ]
    sync(evaluator.device)
    started = time.perf_counter()
    results = dict(evaluator.run(specs))
    sync(evaluator.device)
    return time.perf_counter() - started, results


def trajectory(
    runner,
    samples,
    methods: dict,
    rows: int,
    split: int | None,
    groups: str = "slot",
    fused: bool | None = None,
    lever: dict | None = None,
):
    """fused: None the device's choice, False the explicit products alone, True the fused kernel in every forward;
    lever: more EvaluatorOptions (the CUDA graphs)."""
    with patched(packed, "FUSED_MIN_QUERIES", 0) if fused else nullcontext():
        options = EvaluatorOptions(
            blocks_per_forward=rows, head_split=split, attention_groups=groups, fused_attention=fused, **(lever or {})
        )
        evaluator = TrajectoryEvaluator(runner, set(), options=options, **methods)
        seconds, results = run_timed(evaluator, samples)
    return seconds, completion_tokens(samples), evaluator.counts, {key: result.steps for key, result in results.items()}


@contextmanager
def patched(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@torch.inference_mode()
def reference_loop(model, embed, lm_head: torch.nn.Linear, features, tokens, limits, contiguous: bool) -> list[int]:
    """`dflash_generate`'s draft phase at temperature 0, the target's verification replaced by the true tokens."""
    from dflash.model import _crop_to, _make_cache

    block, device = model.block_size, features.device
    cache = _make_cache(model.config)
    positions = torch.arange(limits.max_length + 1, device=device)[None]
    target_hidden = features[None, : limits.prompt_len]
    start, steps = limits.prompt_len, []
    while start + 1 < limits.max_length:
        verify = min(block, limits.max_length - start)
        ids = torch.full((1, verify), model.mask_token_id, device=device)
        ids[0, 0] = tokens[start]
        hidden = model(
            target_hidden=target_hidden,
            noise_embedding=torch.nn.functional.embedding(ids, embed),
            position_ids=positions[:, start - target_hidden.shape[1] : start + verify],
            past_key_values=cache,
            use_cache=True,
        )[:, 1 - verify :, :]
        _crop_to(cache, start)
        logits = model.compute_logits(hidden.contiguous() if contiguous else hidden, lm_head)
        truth = tokens[start + 1 : start + verify]
        accepted = int((logits[0].argmax(dim=-1)[: len(truth)] == truth).cumprod(dim=0).sum().item())
        produced = min(accepted + 1, limits.max_length - start - 1)
        target_hidden = features[None, start : start + produced]
        start += produced
        steps.append(produced)
    return steps


def sequential(model, embed, lm_head, samples, contiguous: bool) -> tuple[float, int, dict, float]:
    reference_loop(model, embed, lm_head, *samples[0], contiguous)  # warm
    device = embed.device
    sync(device)
    started = time.perf_counter()
    steps = {str(i): reference_loop(model, embed, lm_head, *s, contiguous) for i, s in enumerate(samples)}
    sync(device)
    seconds = time.perf_counter() - started
    count = sum(len(v) for v in steps.values())
    return seconds, completion_tokens(samples), steps, 1000 * seconds / count


def attention_share(runner, samples, methods: dict, rows: int, split: int | None) -> str:
    """Where a trajectory evaluation's time goes: the cross-sample attention (padding to slots, scores against
    each slot's context, softmax, products; not the q/k/v/o projections) against the rest, from the
    profiler's device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    inner = packed._attend

    def labelled(*args, **kwargs):
        with record_function("packed attention"):
            return inner(*args, **kwargs)

    cuda = runner.embed.device.type == "cuda"
    packed._attend = labelled
    try:
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            trajectory(runner, samples, methods, rows, split)
    finally:
        packed._attend = inner
    events = prof.key_averages()
    attr = "device_time_total" if cuda else "cpu_time_total"
    label = next((getattr(e, attr) for e in events if e.key == "packed attention"), 0.0)
    total = sum(getattr(e, "self_device_time_total" if cuda else "self_cpu_time_total") for e in events)
    top = sorted(events, key=lambda e: -getattr(e, "self_device_time_total" if cuda else "self_cpu_time_total"))[:6]
    names = ", ".join(
        f"{e.key[:40]} {100 * getattr(e, 'self_device_time_total' if cuda else 'self_cpu_time_total') / total:.0f}%"
        for e in top
    )
    return f"packed attention {100 * label / total:.0f}% of {'GPU' if cuda else 'CPU'} time; top: {names}"


def agreement(a: dict, b: dict) -> float:
    """Share of the (sample, method) trajectories in b that a took step for step."""
    pairs = [(k, m) for k in b for m in b[k]]
    return sum(a[k][m] == b[k][m] for k, m in pairs) / len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--taus", type=float, nargs="+", default=[3.0, 6.0, 10.0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=64, help="samples for the trajectory evaluator, chain-B")
    parser.add_argument("--default-samples", type=int, default=16, help="... and for the default method set")
    parser.add_argument(
        "--all-anchor-samples", type=int, default=4, help="subset for the all-anchor evaluator, chain-B"
    )
    parser.add_argument("--all-anchor-default-samples", type=int, default=1)
    parser.add_argument("--sequential-samples", type=int, default=1)
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[512],
        help="trajectory blocks per forward (evaluation.blocks_per_forward)",
    )
    parser.add_argument("--chunk", type=int, default=256, help="all-anchor anchors per forward")
    parser.add_argument("--head-split", type=int, default=4)
    parser.add_argument("--levers", action="store_true", help="also the trajectory evaluator without the head split")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--head-spread",
        type=float,
        default=1.5,
        help="sigma of the log of the LM head's row norms (0: equal norms; see the docstring)",
    )
    parser.add_argument(
        "--compare-attention",
        action="store_true",
        help="also the trajectory evaluator with each attention alone (the products; on CUDA the fused kernel)",
    )
    parser.add_argument(
        "--speed-levers",
        action="store_true",
        help="also the trajectory evaluator with CUDA graphs, side by side with today's",
    )
    parser.add_argument("--profile", action="store_true", help="the attention's share of a trajectory evaluation")
    parser.add_argument(
        "--cuda-graph-tokens",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="the CUDA graphs lever: forwards of at most the largest of these flat tokens replay a graph",
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=DEFAULT_METHODS["budgets"],
        help="DDTree budgets of the default set (the ddtree-1024 set: 8..1024)",
    )
    parser.add_argument(
        "--fp32-samples",
        type=int,
        default=0,
        help="with --speed-levers: after the first tau, each lever's steps against today's in fp32 "
        "on this many samples (the exactness rule; 0: none)",
    )
    parser.add_argument(
        "--time-cap",
        type=float,
        default=None,
        help="seconds from the start after which no further row starts (the record keeps what ran)",
    )
    parser.add_argument(
        "--sets", nargs="+", default=["chain-B", "default"], choices=["chain-B", "default", "ddtree-1024"]
    )
    parser.add_argument("--note", default="", help="a line for the record (e.g. the machine's load)")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/evaluator_speed.md")
    smoke_mode(
        parser,
        device="cpu",
        dtype="float32",
        shape="demo",
        taus=[3.0],
        seq_len=32,
        prompt_len=16,
        samples=1,
        default_samples=1,
        all_anchor_samples=1,
        rows=[64],
        chunk=32,
        record=None,
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dflash import DFlashDraftModel

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = drafter_config(**SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype).eval()
        embed = (torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(dtype)
        lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(dtype)
        lm_head.weight.data.normal_(0, 0.02)
        if args.head_spread:  # see the docstring: drafts that bf16 rounding does not flip
            lm_head.weight.data *= torch.exp(args.head_spread * torch.randn(config.vocab_size, 1)).to(dtype)
    runner = BlockDrafter(model, embed, lm_head.weight.detach(), config.dflash_config["mask_token_id"]).to(device)
    block = config.block_size
    default = {"block_sizes": list(range(2, block + 1)), **DEFAULT_METHODS, "budgets": args.budgets}
    started_at = time.perf_counter()

    def out_of_time() -> bool:
        return args.time_cap is not None and time.perf_counter() - started_at > args.time_cap

    graphs = {"cuda_graph_tokens": args.cuda_graph_tokens}
    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    peak = PEAK_TFLOPS if device.type == "cuda" and args.dtype == "bfloat16" else None
    lines = [
        f"## evaluator speed: {machine}, {args.dtype}, shape {args.shape}, seq {args.seq_len}, "
        f"prompt {args.prompt_len}, head spread {args.head_spread:g}, torch {torch.__version__}",
        "",
    ]
    if args.note:
        lines += [args.note, ""]
    ratio = "x all-anchor" if args.all_anchor_samples and args.all_anchor_default_samples else "x first row"
    lines += [
        f"| tau | methods | evaluator | samples | tokens | seconds | tokens/s | {ratio} | x reference loop "
        "| blocks/token | needed TFLOP/s | % of peak |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    checks, rates = [], {}
    for index, tau in enumerate(args.taus):
        if tau > block:
            continue
        if out_of_time():  # no new tau past the cap (each builds its samples and its first rows)
            checks.append(f"tau {tau:g}: not run (--time-cap {args.time_cap:g} s reached)")
            print(checks[-1], flush=True)
            continue
        built = time.perf_counter()
        samples = build_samples(
            runner, max(args.samples, args.default_samples), args.seq_len, args.prompt_len, tau, seed=int(tau * 10)
        )
        print(f"tau {tau}: samples built in {time.perf_counter() - built:.1f} s", flush=True)
        sets = {
            "chain-B": ({}, args.samples, args.all_anchor_samples),
            "default": (default, args.default_samples, args.all_anchor_default_samples),
            "ddtree-1024": ({**default, "budgets": LARGE_BUDGETS}, args.default_samples, 0),
        }
        for name in dict.fromkeys(args.sets):  # in the order asked
            methods, n_traj, n_all = sets[name]
            rows = []  # label, samples, tokens, seconds, blocks per token, needed FLOPs per token
            variants = [(per_forward, args.head_split, "slot", None, {}) for per_forward in args.rows]
            if args.levers:
                variants += [(args.rows[0], None, "slot", None, {}), (args.rows[0], args.head_split, "row", None, {})]
            if args.speed_levers:
                variants += [(args.rows[0], args.head_split, "slot", None, lever) for lever in speed_levers(graphs)]
            if args.compare_attention:  # each attention alone (the device's choice mixes them by queries per group)
                variants += [(args.rows[0], args.head_split, "slot", False, {})]
                if fused_attention_for(device):
                    variants += [(args.rows[0], args.head_split, "slot", True, {})]
            for per_forward, split, groups, fused, lever in variants:
                label = (
                    f"trajectory, {per_forward} rows/forward"
                    + ("" if split else ", whole LM head")
                    + (", attention per block" if groups == "row" else "")
                    + ("" if fused is None else ", fused attention alone" if fused else ", attention as products alone")
                    + lever_label(lever)
                )
                if rows and out_of_time():
                    checks.append(f"tau {tau:g}, {name}, {label}: not run (--time-cap {args.time_cap:g} s reached)")
                    print(checks[-1], flush=True)
                    continue
                try:
                    trajectory(runner, samples[:2], methods, per_forward, split, groups, fused, lever)  # warm
                    seconds, tokens, counts, traj_steps = trajectory(
                        runner, samples[:n_traj], methods, per_forward, split, groups, fused, lever
                    )
                except Exception as error:  # a lever that fails on this machine: say so, measure the others
                    if not rows:
                        raise
                    checks.append(f"tau {tau:g}, {name}, {label}: failed: {type(error).__name__}: {error}"[:600])
                    print(checks[-1], flush=True)
                    continue
                if not rows:
                    answer = traj_steps  # the first variant's steps: what the other evaluators are compared with
                elif lever:
                    checks.append(
                        f"tau {tau:g}, {name}, {label}: steps = today's (first row) on "
                        f"{agreement(traj_steps, answer):.0%} of the (sample, method) trajectories; "
                        f"{counts.forwards} forwards" + graph_note(counts, tokens, seconds)
                    )
                    print(checks[-1], flush=True)
                # In bf16 two variants may take different steps (rounding): each counts the work of its own answer.
                rows.append(
                    [
                        label,
                        n_traj,
                        tokens,
                        seconds,
                        counts.blocks / tokens,
                        needed_flops(config, counts.by_size) / tokens,
                    ]
                )
                print(
                    f"tau {tau:g}, {name}, {label}: {tokens} tokens in {seconds:.2f} s, {counts.rounds} rounds, "
                    f"{counts.forwards} forwards, {counts.blocks / tokens:.3f} blocks/token",
                    flush=True,
                )
            flops_per_token = rows[0][5]  # the first trajectory variant's answer, for the rows of other evaluators
            rates.update({(tau, name, row[0]): row[2] / row[3] for row in rows})
            if name == "ddtree-1024" and (tau, "default", rows[0][0]) in rates:
                for label, *_ in rows:
                    if (tau, "default", label) in rates:
                        ratio = rates[(tau, "default", label)] / rates[(tau, name, label)]  # the same tokens
                        checks.append(
                            f"tau {tau:g}, {label}: budgets 8..1024 take {ratio:.3f}x the time of the default "
                            f"set's budgets {args.budgets} ({ratio - 1:+.1%}; the goal: at most +10%)"
                        )
                        print(checks[-1], flush=True)
            if args.profile:
                checks.append(
                    f"tau {tau:g}, {name}, profile of the trajectory evaluator: "
                    + attention_share(runner, samples[:n_traj], methods, args.rows[0], args.head_split)
                )
                print(checks[-1], flush=True)
            checks.append(f"tau {tau:g}, {name}: chain-B tau {chain_tau(answer, block):.2f}")
            if n_all:  # 0: no all-anchor row (the ratios are then to the first trajectory row)
                if n_all > 1:
                    all_anchor(runner, samples[:1], methods, args.chunk)  # warm
                seconds, tokens, all_steps = all_anchor(runner, samples[:n_all], methods, args.chunk)
                rows.insert(
                    0,
                    [
                        "all-anchor",
                        n_all,
                        tokens,
                        seconds,
                        counts.all_anchor_blocks / completion_tokens(samples[:n_traj]),
                        flops_per_token,
                    ],
                )
                checks[-1] += (
                    f"; the trajectory evaluator's steps = the all-anchor evaluator's on "
                    f"{agreement(answer, all_steps):.0%} of the (sample, method) trajectories both ran"
                )
            print(checks[-1], flush=True)
            reference = None
            if name == "chain-B" and args.sequential_samples:
                needed = sum(len(answer[str(i)][chain_method(block)]) for i in range(args.sequential_samples))
                for contiguous in (False, True):
                    seconds, tokens, seq_steps, step_ms = sequential(
                        model, embed, lm_head, samples[: args.sequential_samples], contiguous
                    )
                    # Its time to result at the steps the answer takes: a random drafter's logits nearly tie, so
                    # the loop's own bf16 rounding can reject a draft the evaluators accept, and take more steps.
                    label = "reference loop" + (", contiguous LM head" if contiguous else ", as published")
                    rows.append(
                        [
                            label,
                            args.sequential_samples,
                            tokens,
                            step_ms * needed / 1000,
                            needed / tokens,
                            flops_per_token,
                        ]
                    )
                    reference = max(reference or 0.0, tokens / (step_ms * needed / 1000))
                    own = {k: {chain_method(block): v} for k, v in seq_steps.items()}
                    checks.append(
                        f"tau {tau:g}: {label}: {step_ms:.2f} ms per step over {seconds:.2f} s, "
                        f"{sum(map(len, seq_steps.values()))} steps of its own (the evaluator's: {needed}); "
                        f"its steps = the trajectory evaluator's on {agreement(answer, own):.0%} of samples"
                    )
                    print(checks[-1], flush=True)
            base = rows[0][2] / rows[0][3]
            for label, n, tokens, seconds, per_token, work in rows:
                rate = tokens / seconds
                tflops = rate * work / 1e12
                cells = [
                    f"{tau:g}",
                    name,
                    label,
                    str(n),
                    str(tokens),
                    f"{seconds:.2f}",
                    f"{rate:,.0f}",
                    f"{rate / base:.2f}",
                    f"{rate / reference:.2f}" if reference else "-",
                    f"{per_token:.3f}",
                    f"{tflops:.2f}",
                    f"{100 * tflops / peak:.1f}%" if peak else "-",
                ]
                lines.append("| " + " | ".join(cells) + " |")
            print("\n".join(lines[-len(rows) :]), flush=True)
            if index == 0 and args.speed_levers and args.fp32_samples and name != "ddtree-1024":
                if out_of_time():
                    checks.append(f"tau {tau:g}, fp32 check: not run (--time-cap {args.time_cap:g} s reached)")
                else:
                    checks += fp32_check(
                        model,
                        embed,
                        lm_head,
                        config,
                        samples[: args.fp32_samples],
                        methods,
                        args,
                        graphs,
                        tau,
                        name,
                        out_of_time,
                    )
                print("\n".join(checks[-4:]), flush=True)
    lines += [""] + [f"- {check}" for check in checks]
    print_and_record(lines, args.record)
    return 0


def speed_levers(graphs: dict) -> list[dict]:
    """The rows after today's: the CUDA graphs, the one lever still under measurement."""
    return [dict(graphs)]


def graph_note(counts, tokens: int, seconds: float) -> str:
    if not counts.graphs:
        return ""
    return (
        f"; {counts.graph_replays} forwards replayed one of {counts.graphs} CUDA graphs, captured in "
        f"{counts.graph_capture_seconds:.2f} s of the row's time (without the captures: "
        f"{tokens / max(seconds - counts.graph_capture_seconds, 1e-9):,.0f} tokens/s)"
    )


def fp32_check(
    model, embed, lm_head, config, samples, methods: dict, args, graphs: dict, tau: float, name: str, out_of_time
) -> list[str]:
    """Each lever's steps against today's evaluator (the first row's options) in fp32 on the same device: the
    issue's exactness rule (bf16 rows may differ by rounding)."""
    import copy

    runner = BlockDrafter(
        copy.deepcopy(model).float(),
        embed.float(),
        lm_head.weight.detach().float(),
        config.dflash_config["mask_token_id"],
    ).to(embed.device)
    samples = [(f.float(), t, lim) for f, t, lim in samples]
    _, _, _, today = trajectory(runner, samples, methods, args.rows[0], args.head_split)
    lines = []
    for lever in speed_levers(graphs):
        label = lever_label(lever).lstrip(", ")
        if out_of_time():
            lines.append(f"tau {tau:g}, {name}, fp32, {label}: not run (--time-cap {args.time_cap:g} s reached)")
            continue
        try:
            _, _, counts, steps = trajectory(runner, samples, methods, args.rows[0], args.head_split, lever=lever)
        except Exception as error:
            lines.append(f"tau {tau:g}, {name}, fp32, {label}: failed: {type(error).__name__}: {error}"[:600])
            continue
        lines.append(
            f"tau {tau:g}, {name}, fp32 on {len(samples)} samples, {label}: steps = today's on "
            f"{agreement(steps, today):.0%} of the (sample, method) trajectories"
            + (f" ({counts.graph_replays} of {counts.forwards} forwards replayed a graph)" if counts.graphs else "")
        )
        print(lines[-1], flush=True)
    del runner
    return lines


def completion_tokens(samples) -> int:
    return sum(limits.total_len - limits.prompt_len for _, _, limits in samples)


def chain_tau(steps: dict, block: int) -> float:
    flat = [s for v in steps.values() for s in v[chain_method(block)]]
    return sum(flat) / len(flat)


if __name__ == "__main__":
    sys.exit(main())
