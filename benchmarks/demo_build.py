"""Time the embedded demo's build on N CPU threads and check its drafters' tau, without a server.

Builds tokenizer, target and drafters with the same CLI calls the workflow makes, then computes
greedy completions of the demo prompts with Hugging Face `generate` (what the served target
returns) and evaluates every drafter from the target's hidden states with our evaluator. Prints a
table and appends it to benchmarks/results/demo_build.md.

    python benchmarks/demo_build.py --out /tmp/demo --threads 2 [--device cuda:0] [--skip-build]

`--device` is demo.build_device (where target and drafters train); the completions and the evaluation run on the
CPU either way. The table ends with whether the drafters' chain tau rises with training (untrained < each step),
the check that a build on any device learned.
"""

from __future__ import annotations

import argparse
import platform
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


def build(
    out: Path, target_steps: int, drafter_steps: list[int], threads: int, sequences: int, device: str = "cpu"
) -> dict[str, float]:
    calls = {
        "tokenizer": ["demo-tokenizer", "--out", str(out / "tokenizer"), "--seed", "0"],
        "target": [
            "demo-target",
            "--tokenizer",
            str(out / "tokenizer"),
            "--out",
            str(out / "target"),
            "--seed",
            "0",
            "--steps",
            str(target_steps),
            "--threads",
            str(threads),
            "--device",
            device,
        ],
        "drafters": [
            "demo-drafters",
            "--target",
            str(out / "target"),
            "--out",
            str(out / "drafters"),
            "--steps",
            *map(str, drafter_steps),
            "--seed",
            "0",
            "--threads",
            str(threads),
            "--sequences",
            str(sequences),
            "--device",
            device,
        ],
    }
    seconds = {}
    for name, args in calls.items():
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dflash_eval.cli", *args], check=True)
        seconds[name] = time.perf_counter() - started
    return seconds


@torch.inference_mode()
def evaluate(
    out: Path, max_tokens: int, drafter_names: list[str], prompts: int | None = None
) -> tuple[dict[str, float], float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_eval.evaluate.acceptance import sequence_limits
    from dflash_eval.evaluate.all_anchor import evaluate_sample
    from dflash_eval.evaluate.blocks import BlockDrafter
    from dflash_eval.evaluate.drafter import load_drafter
    from dflash_eval.extract.backends import bind_backend
    from dflash_eval.fetch.prompts import load_prompts
    from dflash_eval.stats import tau_stats

    bind_backend("torch", "cpu")  # the target runs on the CPU: never fla's Triton kernels, wherever fla imports
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    eos = int(target.generation_config.eos_token_id)
    started = time.perf_counter()
    samples = []
    for prompt in load_prompts(ROOT / "resources/prompts/demo_code.jsonl")[:prompts]:
        ids = tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        full = target.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0]
        hidden = target(full[None], output_hidden_states=True).hidden_states
        samples.append((full, hidden, ids.shape[1]))
    generate_seconds = time.perf_counter() - started
    taus, seconds = {}, {}
    for name in drafter_names:
        started = time.perf_counter()
        loaded = load_drafter(str(out / "drafters" / name), "auto", None, None, False, vocab_size=len(tokenizer))
        runner = BlockDrafter(
            loaded.model, target.model.embed_tokens.weight, target.lm_head.weight, loaded.mask_token_id
        )
        steps = []
        for full, hidden, prompt_len in samples:
            features = torch.cat([hidden[i + 1][0] for i in loaded.layer_ids], dim=-1)
            limits = sequence_limits(prompt_len, len(full), max_tokens, int(full[-1]) == eos)
            # the demo config's methods: every block size, DDTree budgets, top-k
            result = evaluate_sample(
                runner,
                features,
                full,
                limits,
                {eos},
                block_sizes=range(2, loaded.block_size + 1),
                budgets=[8, 16, 32, 64],
                topk=[1, 4, 16],
            )
            steps.append(result.steps)
        taus[name] = {method: tau_stats([s[method] for s in steps])["tau_mean_of_samples"] for method in steps[0]}
        seconds[name] = time.perf_counter() - started
    return taus, seconds, generate_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dflash-demo-build"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="demo.build_device: where target and drafters train")
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--drafter-steps", type=int, nargs="+", default=[60, 250, 900])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--sequences", type=int, default=48, help="the drafters' training sequences (the demo's)")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N demo prompts (default: all)")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/demo_build.md")
    smoke_mode(
        parser,
        out=None,
        threads=1,
        target_steps=1,
        drafter_steps=[1],
        max_tokens=4,
        sequences=2,
        prompts=3,
        record=None,
    )
    args = parser.parse_args()
    smoke_dir = tempfile.TemporaryDirectory() if args.out is None else None  # --smoke: the smallest demo, in a tmp dir
    if smoke_dir:
        args.out = Path(smoke_dir.name)
    torch.set_num_threads(args.threads)
    seconds = (
        {}
        if args.skip_build
        else build(args.out, args.target_steps, args.drafter_steps, args.threads, args.sequences, args.device)
    )
    names = ["untrained"] + [f"step{s}" for s in args.drafter_steps]
    taus, eval_seconds, generate_seconds = evaluate(args.out, args.max_tokens, names, args.prompts)
    lines = [
        f"## demo build on {args.device}, {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, torch {torch.__version__}",
        "",
        "| stage | seconds |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in seconds.items()]
    lines += [f"| greedy completions + hidden states ({args.max_tokens} tokens) | {generate_seconds:.1f} |", ""]
    methods = list(next(iter(taus.values())))
    lines += ["| drafter | evaluation s | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    lines += [
        f"| {k} | {eval_seconds[k]:.1f} | " + " | ".join(f"{v[m]:.3f}" for m in methods) + " |" for k, v in taus.items()
    ]
    own_chain = max((m for m in methods if m.startswith("chain-B")), key=lambda m: int(m.removeprefix("chain-B")))
    chain = [taus[name][own_chain] for name in names]
    rising = all(a < b for a, b in zip(chain, chain[1:]))
    lines += [
        "",
        f"{own_chain} tau {' < '.join(f'{t:.3f}' for t in chain)} in training order: {'yes' if rising else 'NO'}",
    ]
    print_and_record(lines, args.record)
    return 0 if rising or smoke_dir else 1


if __name__ == "__main__":
    sys.exit(main())
