"""Is the expected speedup right? It, beside the measured wall-clock speedup of a live loop, per cell.

Two live loops (`--loop`, `graphs` by default on CUDA):
- `graphs`: a loop that runs like a server (dflash_eval/speedup/live_loops/chain.py): static KV caches, the target's
  forward captured as a CUDA graph at size 1 (autoregressive) and b (a chain verify), the drafter's at block b,
  greedy acceptance on the device, one host sync per step (on a CPU the same loop runs eagerly). A Gated DeltaNet
  hybrid runs speedup/live_loops/hybrid.py: its recurrent and conv states after the kept prefix of a verify
  are replayed from the untouched pre-verify state inside the captured accept step (SGLang instead writes
  per-token states in its verify kernel), a per-step term of this loop that `accept+host` holds.
- `eager`: `dflash.model.dflash_generate` (batch 1, temperature 0; exact rollback on a hybrid target) against the
  same function at block size 1 (the same cache, the same host sync per step), HF transformers + fla on CUDA.
Speedup = decode time of the autoregressive loop / decode time of the speculative one for the same number of
new tokens (no stop tokens). Acceptance is simulated (dflash_eval/speedup/simulate.py: SGLang 0.5.23's
SGLANG_SIMULATE_ACC_LEN, match-expected, real-draft-token): the drafter runs its forward, then each step
commits k tokens, k the floor or ceiling of the asked tau; `live` cells keep the random drafter's own
acceptance (about 1).

Predicted: the product's estimate, tau x T_AR / (T_draft + T_verify(b)) (speedup/model.py), from the same
device's profile of the same model: T_AR and T_verify(n) timed as the profile_target rule times them (tools/target_timing.py,
measured twice: the two runs' ratio per size shows whether it repeats within 5%), T_draft as evaluation times
it (evaluate/draft_timing.py, block b, projecting round(tau) new context rows), and the tau the loop realised
(token-weighted). Beside it, for the graph loop, the same formula from the terms that loop pays, each timed
alone (StaticLoop.step_terms): its T_AR (the size-1 graph), T_draft and T_verify(b) graphs, and then with the
per-step accept + host round trip added to both sides (also added to the product's terms, a column of its own,
less a hybrid's state commit, which the profile's hybrid verify holds since the fifth H200 round). On a hybrid
target (eager loop) a second prediction adds the measured exact-rollback replay (a forward of the k kept tokens
after each partial acceptance).

Shapes (random weights): `demo` (the demo's target and drafter shapes), `27b` (Qwen3.6-27B per-layer shape: a
Gated DeltaNet hybrid, `--layers` of its 64 layers, its DFlash drafter's shape), `8b` (Qwen3-8B per-layer
shape, pure attention, `--layers` of 36), `tiny` and `tiny-attention` (the smoke's). With fewer layers nothing
is scaled: both sides are of the reduced model, so a cell validates the estimate for that model, and its
speedup is not the full model's. DDTree (`--budgets`, pure-attention shapes in the graph loop): the live tree
loop of speedup/live_loops/tree.py at the drafter's block (one target pass under a tree mask, the accepted path's keys
compacted), its T_verify(N + 1) from the same profile. Each shape's section is printed (and recorded) as soon
as it is done; `--max-seconds` starts no new cell past it.

    python benchmarks/speedup_validation.py --device cuda --shapes 8b,27b --seconds-per-size 1 --max-seconds 180 \
        --record $OUT/speedup_validation.md
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    checkout_commit,
    print_and_record,
    smoke_mode,
)

from dflash_eval.demo.live_loop import is_hybrid, measured_speedup, run_loop
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.draft_timing import drafter_step_ms
from dflash_eval.evaluate.draft_timing import timing_method as draft_timing_method
from dflash_eval.extract.backends import bind_backend, gdn_kernels
from dflash_eval.speedup import validation
from dflash_eval.speedup.labels import MEASURED
from dflash_eval.speedup.live_loops.run import LoopRun
from dflash_eval.speedup.model import expected_speedup
from dflash_eval.speedup.timing import compare
from dflash_eval.tools.target_timing import measure_target

ROOT = Path(__file__).resolve().parents[1]

# per shape: the target (hybrid or attention), its layer count in full, and the drafter's dimensions
SHAPES = {
    "tiny": dict(
        kind="hybrid",
        layers=4,
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=16,
        lin_k=2,
        lin_v=4,
        lin_dim=16,
        vocab=300,
        d_layers=2,
        d_heads=4,
        d_kv=2,
        d_head_dim=16,
        d_inter=128,
        window=16,
        full_layers=4,
    ),
    "tiny-attention": dict(
        kind="attention",
        layers=3,
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=300,
        d_layers=2,
        d_heads=4,
        d_kv=2,
        d_head_dim=16,
        d_inter=128,
        window=16,
        full_layers=3,
    ),
    "demo": dict(
        kind="hybrid",
        layers=8,
        hidden=128,
        intermediate=256,
        heads=4,
        kv_heads=2,
        head_dim=32,
        lin_k=1,
        lin_v=2,
        lin_dim=32,
        vocab=4096,
        d_layers=2,
        d_heads=4,
        d_kv=2,
        d_head_dim=32,
        d_inter=256,
        window=64,
        full_layers=8,
    ),
    "27b": dict(
        kind="hybrid",
        layers=8,
        hidden=5120,
        intermediate=17408,
        heads=24,
        kv_heads=4,
        head_dim=256,
        lin_k=16,
        lin_v=48,
        lin_dim=128,
        vocab=248320,
        d_layers=5,
        d_heads=32,
        d_kv=8,
        d_head_dim=128,
        d_inter=17408,
        window=2048,
        full_layers=64,
    ),
    "8b": dict(
        kind="attention",
        layers=12,
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        d_layers=5,
        d_heads=32,
        d_kv=8,
        d_head_dim=128,
        d_inter=12288,
        window=2048,
        full_layers=36,
    ),
}


def target_config(shape: dict, layers: int):
    if shape["kind"] == "attention":
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=shape["vocab"],
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_hidden_layers=layers,
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            head_dim=shape["head_dim"],
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        )
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        linear_num_key_heads=shape["lin_k"],
        linear_num_value_heads=shape["lin_v"],
        linear_key_head_dim=shape["lin_dim"],
        linear_value_head_dim=shape["lin_dim"],
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )


def drafter_config(shape: dict, layers: int, block: int):
    """The z-lab drafter layout: sliding-window layers then one full-attention layer, non-causal in the block."""
    from transformers import Qwen3Config

    from dflash_eval.demo.drafters import default_layer_ids

    n = shape["d_layers"]
    return Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["d_inter"],
        num_hidden_layers=n,
        num_attention_heads=shape["d_heads"],
        num_key_value_heads=shape["d_kv"],
        head_dim=shape["d_head_dim"],
        max_position_embeddings=40960,
        rope_theta=10_000_000.0,
        layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
        use_sliding_window=True,
        sliding_window=shape["window"],
        max_window_layers=0,
        architectures=["DFlashDraftModel"],
        block_size=block,
        num_target_layers=layers,
        dflash_config={
            "mask_token_id": shape["vocab"] - 2,
            "target_layer_ids": sorted({min(i, layers - 1) for i in default_layer_ids(max(layers, 5), n)}),
        },
    )


def build(shape: dict, layers: int, block: int, device: torch.device, dtype: torch.dtype):
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            target = AutoModelForCausalLM.from_config(target_config(shape, layers)).eval()
            drafter = DFlashDraftModel(drafter_config(shape, layers, block)).eval()
    finally:
        torch.set_default_dtype(previous)
    return target, drafter


def loops(
    drafter, target, prompts: list[torch.Tensor], new_tokens: int, block: int, tau: float | None, seed: int
) -> list[LoopRun]:
    return [run_loop(drafter, target, prompt, new_tokens, block, tau, seed + i) for i, prompt in enumerate(prompts)]


def pooled(runs: list[LoopRun]) -> LoopRun:
    return LoopRun(
        sum(r.decode_s for r in runs), sum(r.new_tokens for r in runs), [k for r in runs for k in r.acceptance_lengths]
    )


def replay_ms(run: LoopRun, block: int, verify: dict[str, float]) -> float:
    """Mean per step of the exact rollback's replay: a forward of the k kept tokens after each partial step."""
    return sum(verify[str(k)] for k in run.acceptance_lengths if k < block) / len(run.acceptance_lengths)


def two_profiles(target, context: int, sizes: list[int], args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """The product's profile (tools/target_timing.py), measured twice back to back, and how the two compare."""
    first, second = (
        measure_target(target, context, args.repeats, sizes, seconds_per_size=args.seconds_per_size) for _ in range(2)
    )
    return first, second, compare(first["t_verify_ms"], second["t_verify_ms"], "speedup_validation profile")


def profile_lines(first: dict, second: dict, agreement: dict) -> list[str]:
    ratios = ", ".join(f"{n}: {r:.3f}" for n, r in sorted(agreement["ratios"].items(), key=lambda kv: int(kv[0])))
    unstable = sorted(set(first["spread"]["unstable"]) | set(second["spread"]["unstable"]))
    return [
        "",
        f"Profile repeatability (tools/target_timing.py twice, method {first['method']}, run 2 / run 1 per "
        f"verified size): {ratios}; "
        f"beyond 5%: {', '.join(agreement['beyond_5_percent']) or 'none'}; T_AR {first['t_ar_ms']:.2f} / "
        f"{second['t_ar_ms']:.2f} ms; sizes whose median CI stayed wider than ±2% at the cap: "
        f"{', '.join(map(str, unstable)) or 'none'}. Predictions use run 1.",
    ]


def product_draft_step(
    runner,
    features,
    tokens,
    context: int,
    args: argparse.Namespace,
    block: int,
    tau: float,
    target_method: str,
    budget: int | None = None,
) -> tuple[float, str]:
    """T_draft as evaluation times it (evaluate/draft_timing.py): block b (a DDTree's `budget`: its whole drafting
    step, top-N, read and tree build included), round(tau) new context rows, the method chosen as evaluation
    chooses it from the target profile's (graphs beside a graph-timed T_AR); (ms, that method)."""
    method, why = draft_timing_method(runner, tokens.device, target_method)
    timing = drafter_step_ms(
        runner,
        features,
        tokens[: context + 1],
        context,
        args.repeats,
        block,
        max(1, round(tau)),
        method,
        why,
        budget=budget,
    )
    return timing["ms"], timing["method"]


def due_taus(taus: list[str], cell: str, deadline: float, skipped: list[str]):
    """(tau, the simulated tau or None for live) per tau of a cell, those past the deadline listed as skipped."""
    for tau in taus:
        if time.perf_counter() > deadline:
            skipped.append(f"{cell} tau {tau}")
            continue
        yield tau, None if tau == "live" else float(tau)


def add_cell(
    args: argparse.Namespace, shape: str, target: str, kind: str, ratio: float, profile_method: str, draft_method: str
) -> None:
    """One cell's measured / estimated (the product's estimate), for the validation record."""
    args.cells.append(
        {
            "shape": shape,
            "target": target,
            "kind": kind,
            "ratio": ratio,
            "profile_method": profile_method,
            "draft_method": draft_method,
        }
    )


def record_validation(args: argparse.Namespace, device_name: str) -> None:
    """The cells, one entry per shape x kind, into the package's validation record (speedup/validation.py)."""
    if args.validation_record is None or not args.cells:
        return
    commit = checkout_commit(ROOT)
    groups: dict[tuple[str, str], list[dict]] = {}
    for cell in args.cells:
        groups.setdefault((cell["shape"], cell["kind"]), []).append(cell)
    validation.update(
        [
            validation.entry(
                cells,
                MEASURED,
                device_name,
                time.strftime("%Y-%m-%d"),
                commit,
                "benchmarks/results/speedup_validation.md",
            )
            for cells in groups.values()
        ],
        args.validation_record,
    )
    print(f"validation record updated: {args.validation_record} ({len(groups)} entries)")


def static_rows(
    name: str,
    shape: dict,
    layers: int,
    target,
    drafter,
    prompts,
    runner,
    features,
    tokens,
    context: int,
    args: argparse.Namespace,
    device: torch.device,
    deadline: float,
    skipped: list[str],
) -> list[str]:
    """The graph loop's section: the product's prediction, the loop's own terms, and the measured speedup. A Gated
    DeltaNet hybrid runs speedup/live_loops/hybrid.py (fla on CUDA, chosen by name; the recurrent state after
    the kept prefix replayed inside the accept graph), a pure-attention target speedup/live_loops/chain.py's."""
    from dflash_eval.speedup.live_loops.chain import StaticLoop
    from dflash_eval.speedup.live_loops.hybrid import StaticHybridLoop

    blocks = sorted(args.blocks)
    graphs = device.type == "cuda"
    hybrid = is_hybrid(target)
    loop_class = StaticHybridLoop if hybrid else StaticLoop
    target_kind = "Gated DeltaNet hybrid" if hybrid else "pure attention"
    built = time.perf_counter()
    kernels = {"kernels": gdn_kernels(None, device)} if hybrid else {}  # fla on CUDA, torch elsewhere: by name
    loop = loop_class(target, drafter, args.prompt_tokens + args.new_tokens + 1, blocks, graphs=graphs, **kernels)
    for block in blocks:  # warm-up
        loop.generate(prompts[0], min(8, args.new_tokens), block, 2.0)
    captured_s = time.perf_counter() - built
    replay_check = "not checked (no graphs on this device)"
    if graphs:  # the graphs' tokens and steps against the same loop run eagerly (tests/speedup holds it in fp32)
        eager = loop_class(target, drafter, args.prompt_tokens + args.new_tokens + 1, blocks, graphs=False, **kernels)
        a, b = (each.generate(prompts[0], args.new_tokens, max(blocks), 4.0, seed=7) for each in (loop, eager))
        same = a.acceptance_lengths == b.acceptance_lengths and torch.equal(a.output_ids, b.output_ids)
        replay_check = "equal" if same else "DIFFERENT"
        del eager
    autoregressive = pooled([loop.generate(p, args.new_tokens, 1) for p in prompts])
    ar_terms = loop.step_terms(1, args.repeats, args.seconds_per_size, at=context)
    trees = [n + 1 for n in args.budgets]
    first, second, agreement = two_profiles(target, context, sorted({1, *blocks, *trees}), args)
    t_ar, verify = first["t_ar_ms"], first["t_verify_ms"]
    committed = bool(first.get("verify_includes_state_commit"))  # a hybrid's static profile (tools/target_timing.py)
    ar_loop, ar_host = ar_terms["verify"]["ms"], ar_terms["accept_host"]["ms"]
    kind = "CUDA graphs" if graphs else "static cache, eager (no graphs on this device)"
    head = (
        f"### {name}: {layers} of {shape['full_layers']} layers ({target_kind}), loop `graphs` ({kind}; "
        f"captured and warmed in {captured_s:.0f} s; graph replay against the eager static loop at block "
        f"{max(blocks)}, tau 4: {replay_check}), {args.prompts} prompts x {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens, profile context {context}. T_AR: the product's profile "
        f"{t_ar:.2f} ms ({first['method']}); the loop's size-1 graph {ar_loop:.2f} ms + accept/host {ar_host:.2f} ms; "
        f"the loop's autoregressive decode measured {autoregressive.ms_per_step:.2f} ms/token; the product's "
        f"T_draft timed {draft_timing_method(runner, device, first['method'])[0]} (evaluate/draft_timing.py)"
    )
    rows = [
        "",
        head,
        *profile_lines(first, second, agreement),
        "",
        "| block | tau asked | tau realised | T_draft ms product / loop | T_verify(b) ms profile / loop"
        f"{' (with the state commit)' if committed else ''} | "
        "accept+host ms | ms/step measured | predicted (product) | predicted (product + host) | "
        "predicted (loop terms) | predicted (loop terms + host) | measured | measured / predicted (product) | "
        "measured / predicted (loop + host) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for block in blocks:
        terms = loop.step_terms(block, args.repeats, args.seconds_per_size, at=context)
        draft, check, host = terms["draft"]["ms"], terms["verify"]["ms"], terms["accept_host"]["ms"]
        # the profile's hybrid verify holds its state commit (tools/target_timing.py); the loop's is the rollback term,
        # which its accept + host time holds too
        commit = terms["rollback"]["ms"] if committed else 0.0
        for tau, asked in due_taus(args.taus, f"{name} b{block}", deadline, skipped):
            run = pooled(
                [loop.generate(p, args.new_tokens, block, asked, 1000 * block + i) for i, p in enumerate(prompts)]
            )
            product_draft, draft_method = product_draft_step(
                runner, features, tokens, context, args, block, run.tau, first["method"]
            )
            product = expected_speedup(run.tau, t_ar, product_draft, verify[str(block)])
            product_host = expected_speedup(run.tau, t_ar + ar_host, product_draft + host - commit, verify[str(block)])
            from_loop = expected_speedup(run.tau, ar_loop, draft, check)
            with_host = expected_speedup(run.tau, ar_loop + ar_host, draft + check + host, 0.0)
            measured = measured_speedup(autoregressive, run)
            add_cell(args, name, target_kind, "chain", measured / product, first["method"], draft_method)
            rows.append(
                f"| {block} | {tau} | {run.tau:.2f} | {product_draft:.2f} / {draft:.2f} | "
                f"{verify[str(block)]:.2f} / {check + commit:.2f} | {host:.3f} | {run.ms_per_step:.2f} | "
                f"{product:.2f} | {product_host:.2f} | {from_loop:.2f} | {with_host:.2f} | {measured:.2f} | "
                f"{measured / product:.3f} | {measured / with_host:.3f} |"
            )
    # no tree verify on a hybrid (speedup/live_loops/hybrid.py refuses it; docs/speedup.md)
    if args.budgets and not hybrid:
        rows += tree_rows(
            name,
            target,
            drafter,
            prompts,
            runner,
            features,
            tokens,
            context,
            args,
            autoregressive,
            first,
            deadline,
            skipped,
        )
    return rows


def tree_rows(
    name: str,
    target,
    drafter,
    prompts,
    runner,
    features,
    tokens,
    context: int,
    args: argparse.Namespace,
    autoregressive: LoopRun,
    profile: dict,
    deadline: float,
    skipped: list[str],
) -> list[str]:
    """DDTree cells: the live tree loop (speedup/live_loops/tree.py) at the drafter's block, per budget and tau."""
    from dflash_eval.speedup.live_loops.tree import TreeLoop

    block = max(args.blocks)
    built = time.perf_counter()
    loop = TreeLoop(
        target,
        drafter,
        args.prompt_tokens + args.new_tokens + 1,
        block,
        args.budgets,
        graphs=torch.device(args.device).type == "cuda",
    )
    for budget in args.budgets:  # warm-up
        loop.generate_tree(prompts[0], min(8, args.new_tokens), budget, 2.0)
    t_ar, verify = profile["t_ar_ms"], profile["t_verify_ms"]
    rows = [
        "",
        f"DDTree live loop (speedup/live_loops/tree.py; drafter block {block}, its greedy chain as the "
        f"simulated tree's spine; target draft and verify {'CUDA graphs' if loop.graphs else 'eager'}, tree "
        f"built and walked on the host; captured and warmed in {time.perf_counter() - built:.0f} s). "
        "Predicted (product) = tau x T_AR / (T_draft(N) + T_verify(N + 1)) from the profile above, T_draft(N) "
        "the product's DDTree drafting step (the drafter's block, the top-N of its positions, their read, the "
        "tree's build and upload: evaluate/draft_timing.py); + walk adds the loop's measured host time per "
        "step walking the verified tree (the one host term T_draft(N) leaves out) to the denominator; the "
        "loop's tree build, already in T_draft(N), is shown beside it. Rounds before the fifth added both "
        "(the build counted twice).",
        "",
        "| budget N | tau asked | tau realised | T_draft(N) ms | T_verify(N+1) ms | build ms/step | walk ms/step "
        "| ms/step measured | predicted (product) | predicted (product + walk) | measured | "
        "measured / predicted (product) | measured / predicted (+ walk) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    phases: list[str] = []
    for budget in args.budgets:
        for tau, asked in due_taus(args.taus, f"{name} ddtree-{budget}", deadline, skipped):
            runs = [
                loop.generate_tree(p, args.new_tokens, budget, asked, 1000 * budget + i) for i, p in enumerate(prompts)
            ]
            run = pooled(runs)
            steps = len(run.acceptance_lengths)
            build, walk = (1e3 * sum(getattr(r, f) for r in runs) / steps for f in ("build_s", "walk_s"))
            draft, draft_method = product_draft_step(
                runner, features, tokens, context, args, block, run.tau, profile["method"], budget
            )
            check = verify[str(budget + 1)]
            product = expected_speedup(run.tau, t_ar, draft, check)
            with_walk = expected_speedup(run.tau, t_ar, draft + walk, check)
            measured = measured_speedup(autoregressive, run)
            add_cell(args, name, "pure attention", "ddtree", measured / product, profile["method"], draft_method)
            rows.append(
                f"| {budget} | {tau} | {run.tau:.2f} | {draft:.2f} | {check:.2f} | {build:.3f} | {walk:.3f} | "
                f"{run.ms_per_step:.2f} | {product:.2f} | {with_walk:.2f} | {measured:.2f} | "
                f"{measured / product:.3f} | {measured / with_walk:.3f} |"
            )
            phases.append(phase_row(loop, prompts, args, budget, tau, asked, run, draft + check))
    del loop
    return rows + phase_table(phases)


def phase_row(
    loop, prompts, args: argparse.Namespace, budget: int, tau: str, asked: float | None, run: LoopRun, terms_ms: float
) -> str:
    """One untimed-for-speedup pass with the loop's breakdown (each phase synchronised and clocked): ms/step per
    phase, and what the timed run paid beyond the product's T_draft + T_verify(N + 1)."""
    from dflash_eval.speedup.live_loops.tree import PHASES

    runs = [
        loop.generate_tree(p, args.new_tokens, budget, asked, 1000 * budget + i, breakdown=True)
        for i, p in enumerate(prompts)
    ]
    steps = sum(len(r.acceptance_lengths) for r in runs)
    ms = {phase: 1e3 * sum(r.phases_s[phase] for r in runs) / steps for phase in PHASES}
    cells = " | ".join(f"{ms[phase]:.3f}" for phase in PHASES)
    return (
        f"| {budget} | {tau} | {cells} | {sum(ms.values()):.2f} | {run.ms_per_step:.2f} | {terms_ms:.2f} | "
        f"{run.ms_per_step - terms_ms:.2f} |"
    )


def phase_table(phases: list[str]) -> list[str]:
    """Where a DDTree step's time goes, by phase (TreeLoop.generate_tree's breakdown)."""
    if not phases:
        return []
    return [
        "",
        "DDTree step by phase (a separate pass with breakdown=True, each phase synchronised and clocked on "
        "the host, ms/step; not the timed runs above, which sync once per step): draft graph + its top-k read, "
        "host tree build + its upload, verify graph + its argmax read (greedy only; simulated: a sync), host "
        "walk, the walk's upload + accept graph. Beyond = the timed run's ms/step - (T_draft + T_verify(N+1)) "
        "of the product.",
        "",
        "| budget N | tau asked | draft + read ms | build + upload ms | verify + read ms | walk ms | accept ms | "
        "phases sum ms | ms/step measured | T_draft + T_verify(N+1) ms | beyond ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *phases,
    ]


def eager_rows(
    name: str,
    shape: dict,
    layers: int,
    target,
    drafter,
    prompts,
    runner,
    features,
    tokens,
    context: int,
    args: argparse.Namespace,
    why: str,
    deadline: float,
    skipped: list[str],
) -> list[str]:
    """dflash_generate against itself at block 1 (HF eager; exact rollback on a hybrid)."""
    blocks = sorted(args.blocks)
    hybrid = is_hybrid(target)
    run_loop(drafter, target, prompts[0], min(8, args.new_tokens), max(blocks), 2.0)  # warm-up: kernels, tuning
    run_loop(drafter, target, prompts[0], min(8, args.new_tokens), 1)
    autoregressive = pooled(loops(drafter, target, prompts, args.new_tokens, 1, None, 0))
    sizes = list(range(1, max(blocks) + 1)) if hybrid else sorted({1, *blocks})  # the replay verifies k < b
    first, second, agreement = two_profiles(target, context, sizes, args)
    t_ar, verify = first["t_ar_ms"], first["t_verify_ms"]
    head = (
        f"### {name}: {layers} of {shape['full_layers']} layers ({'Gated DeltaNet hybrid' if hybrid else 'pure attention'}"
        f"), loop `eager` ({why}), {args.prompts} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new "
        f"tokens, profile context {context}; autoregressive loop {autoregressive.ms_per_step:.2f} ms/token, "
        f"profile T_AR {t_ar:.2f} ms"
    )
    rows = [
        "",
        head,
        *profile_lines(first, second, agreement),
        "",
        "| block | tau asked | tau realised | T_draft ms | T_verify(b) ms | ms/step model | "
        "ms/step measured | predicted | predicted + replay | measured | measured / predicted |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for block in blocks:
        for tau, asked in due_taus(args.taus, f"{name} b{block}", deadline, skipped):
            run = pooled(loops(drafter, target, prompts, args.new_tokens, block, asked, 1000 * block))
            draft, draft_method = product_draft_step(
                runner, features, tokens, context, args, block, run.tau, first["method"]
            )
            predicted = expected_speedup(run.tau, t_ar, draft, verify[str(block)])
            replay = replay_ms(run, block, verify) if hybrid else 0.0
            with_replay = expected_speedup(run.tau, t_ar, draft + replay, verify[str(block)]) if hybrid else None
            measured = measured_speedup(autoregressive, run)
            add_cell(
                args,
                name,
                "Gated DeltaNet hybrid" if hybrid else "pure attention",
                "chain",
                measured / predicted,
                first["method"],
                draft_method,
            )
            rows.append(
                f"| {block} | {tau} | {run.tau:.2f} | {draft:.2f} | {verify[str(block)]:.2f} | "
                f"{draft + verify[str(block)] + replay:.2f} | {run.ms_per_step:.2f} | {predicted:.2f} | "
                + ("-" if with_replay is None else f"{with_replay:.2f}")
                + f" | {measured:.2f} | {measured / (with_replay or predicted):.3f} |"
            )
    return rows


def shape_rows(
    name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, deadline: float, skipped: list[str]
) -> list[str]:
    shape = SHAPES[name]
    layers = args.layers or shape["layers"]
    started = time.perf_counter()
    target, drafter = build(shape, layers, max(args.blocks), device, dtype)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, shape["vocab"] - 4, (1, args.prompt_tokens), generator=generator).to(device)
        for _ in range(args.prompts)
    ]
    context = args.prompt_tokens + args.new_tokens // 2  # the mean context over the decode
    runner = BlockDrafter(
        drafter,
        target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
        drafter.mask_token_id,
    ).to(device)
    features = torch.randn(context + 1, len(drafter.target_layer_ids) * shape["hidden"], generator=generator)
    features, tokens = features.to(device=device, dtype=dtype), prompts[0][0].repeat(context // args.prompt_tokens + 2)
    common = (name, shape, layers, target, drafter, prompts, runner, features, tokens, context, args)
    if args.loop == "graphs":
        try:
            rows = static_rows(*common, device, deadline, skipped)
        except Exception as error:  # noqa: BLE001  recorded, and the shape still gets the eager loop's cells
            if args.smoke:  # the smoke is the graph loop's test on the CPU: a failure there must fail it
                raise
            traceback.print_exc()
            rows = eager_rows(*common, f"the graph loop failed: {type(error).__name__}: {error}", deadline, skipped)
    else:
        rows = eager_rows(*common, "asked", deadline, skipped)
    rows[1] += f" (model built in {time.perf_counter() - started:.0f} s with everything above)"
    del target, drafter, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="8b,27b,demo", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="target layers (default: the shape's)")
    parser.add_argument(
        "--loop",
        choices=["graphs", "eager"],
        default=None,
        help="graphs: the static-cache loop (CUDA graphs on CUDA; default there); eager: "
        "dflash_generate (default on a CPU)",
    )
    parser.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16])
    parser.add_argument(
        "--budgets",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[16, 64, 256],
        help="DDTree budgets (pure-attention shapes, graph loop; empty: none)",
    )
    parser.add_argument(
        "--taus",
        type=lambda s: s.split(","),
        default="2,4,6,8,10".split(","),
        help="asked tau per cell (comma-separated; `live`: the drafter's own acceptance)",
    )
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--seconds-per-size",
        type=float,
        default=2.0,
        help="the profile's cap per size (it stops earlier once the median's 95%% CI is within ±2%%)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="start no new cell after this long (the skipped cells are listed)",
    )
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/speedup_validation.md")
    parser.add_argument(
        "--validation-record",
        type=Path,
        default=validation.RECORD,
        help="the package's record of measured / estimated per shape and kind, which the report "
        "prints beside each estimate (speedup/validation.py); commit it with the .md record",
    )
    smoke_mode(
        parser,
        device="cpu",
        shapes="tiny-attention,tiny",
        loop="graphs",
        blocks=[4],
        taus=["2"],
        budgets=[6],
        prompts=1,
        prompt_tokens=12,
        new_tokens=12,
        repeats=2,
        seconds_per_size=0.2,
        record=None,
        validation_record=None,
    )
    args = parser.parse_args()
    args.cells = []
    device = torch.device(args.device)
    if device.type != "cuda" and not args.smoke:  # a CPU's timings say nothing about serving: printed, never kept
        if args.record == parser.get_default("record"):
            args.record = None
        args.validation_record = None
        print(
            "on a CPU nothing is recorded by default (the .md record needs --record; the validation record is "
            "never written)"
        )
    args.loop = args.loop or ("graphs" if device.type == "cuda" else "eager")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  loaded, so that the binding reaches it

    backend = "fla" if device.type == "cuda" else "torch"
    bind_backend(backend, device)
    began = time.perf_counter()
    deadline = began + args.max_seconds
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_and_record(
        [
            f"## speedup_validation {time.strftime('%Y-%m-%d')}: {name}, torch {torch.__version__}, "
            f"{dtype}, Gated DeltaNet backend {backend}, loop {args.loop}, batch 1, simulated acceptance "
            f"(SGLang match-expected, real-draft-token); profile {args.repeats} repeats per size, cap "
            f"{args.seconds_per_size:g} s"
        ],
        args.record,
    )
    skipped: list[str] = []
    for shape in args.shapes.split(","):  # each section is printed and recorded once done: a cut run keeps it
        if time.perf_counter() > deadline:
            skipped.append(f"{shape} (all cells)")
            continue
        print_and_record(shape_rows(shape, args, device, dtype, deadline, skipped), args.record)
    record_validation(args, name)
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
