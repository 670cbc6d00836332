"""Offline = online on one device, per dtype: our extract + evaluate against `dflash_generate` run live.

For each dtype, on the same device, with the same Gated DeltaNet kernels (`--backend`, verified by
extract.backends for both sides):

- offline: the extract stage (`extract.stage.extract`) caches the target's states of the served
  completions, and the evaluate stage (`evaluate.stage.run_evaluation`) scores the drafter's own-block
  chain on them: what the workflow computes;
- live: `dflash.model.dflash_generate` (temperature 0) with the same target and drafter loaded in that
  dtype, with exact cache rollback (tests/support/reference.py: transformers' crop does not rewind the
  Gated DeltaNet states), from each served prompt, as many tokens as the served request asked for.

Per dtype it gives the share of samples whose acceptance lengths are equal step for step, how many
live completions differ from the served ones (offline follows the served tokens, live its own), how
many are equal among the samples whose live completion is the served one, at the first differing step
which side accepted more, and tau (mean over samples, z-lab) live and offline with the paired
difference and its bootstrap CI (evaluate.acceptance.paired_difference). `--repeats N` runs the live
loop N times to show whether it repeats itself. Per-sample steps go to `--json`.

    python benchmarks/fidelity.py --target resources/demo/target --drafter resources/demo/drafters/step900 \\
        --completions results/completions/demo-code.jsonl --device cuda:0 --backend fla \\
        --dtypes float32 bfloat16 --json fidelity.json

Prints the table and appends it to benchmarks/results/fidelity.md.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import print_and_record  # benchmarks/record.py (the script's own folder)

from dflash_eval.completions import read_completions, serialize
from dflash_eval.config import stage_settings
from dflash_eval.evaluate.acceptance import paired_difference
from dflash_eval.evaluate.anchors import chain_method
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.stage import run_evaluation, stop_token_ids
from dflash_eval.extract.backends import package_versions, use_backend
from dflash_eval.extract.stage import extract
from dflash_eval.extract.target import load_target, parse_dtype
from dflash_eval.io_utils import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tests.support is importable
from tests.support.reference import first_difference, online_acceptance  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "fidelity.md"


def offline_steps(args: argparse.Namespace, dtype: str, drafter, completions: Path, work: Path) -> dict[str, list[int]]:
    """The workflow's own numbers: extract the served completions' states, evaluate the drafter's own chain."""
    target = {"path": str(args.target), "dtype": dtype, "device": args.device, "backend": args.backend}
    hidden = work / f"hidden-{dtype}"
    extract({"dataset": "fidelity", "layer_ids": drafter.layer_ids, "last_layer": "final_norm", "target": target,
             "server": None}, completions, hidden)
    settings = stage_settings("evaluate", {
        "drafter": Path(args.drafter).name, "dataset": "fidelity", "target": {"path": str(args.target)},
        "checkpoint": {"path": str(args.drafter), "layer_ids": drafter.layer_ids},
        "device": args.device, "dtype": dtype, "block_sizes": [drafter.block_size], "ddtree_budgets": [],
        "topk": [1],
        # the drafter was trained on torch-kernel states; here both sides run --backend, which is the point
        "allow_backend_mismatch": True,
    })
    _, frame = run_evaluation(settings, str(hidden), str(completions))
    frame = frame[frame["method"] == chain_method(drafter.block_size)]
    return {str(row.id): [int(x) for x in str(row.acceptance_lengths).split()] for row in frame.itertuples()}


def live_runs(args: argparse.Namespace, dtype: str, records: list[dict], stops: list[int]) -> tuple[list[dict], dict]:
    """`dflash_generate` from every served prompt, `--repeats` times: per run, id -> (steps, completion ids)."""
    target, _ = load_target(args.target, dtype, args.device)
    drafter = load_drafter(args.drafter).model.to(device=target.device, dtype=parse_dtype(dtype)).eval()
    runs = []
    with use_backend(args.backend, args.device, target) as backend:
        for _ in range(args.repeats):
            run = {}
            for record in records:
                prompt = record["prompt_token_ids"]
                steps, ids = online_acceptance(drafter, target, prompt, int(record["request"]["max_tokens"]), stops)
                run[str(record["id"])] = {"steps": steps, "completion_ids": ids[len(prompt):]}
            runs.append(run)
        info = backend.verify()
    del target, drafter
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs, info.to_manifest()


def direction(offline: list[int], live: list[int]) -> str | None:
    """Which side accepted more at the first differing step; "prefix" when one list ends first."""
    step = first_difference(offline, live)
    if step is None:
        return None
    if step >= min(len(offline), len(live)):
        return "prefix"
    return "offline" if offline[step] > live[step] else "live"


def tau(steps: dict[str, list[int]]) -> float:
    values = [sum(s) / len(s) for s in steps.values() if s]
    return sum(values) / len(values) if values else math.nan


def compare(records: list[dict], offline: dict[str, list[int]], runs: list[dict], n_boot: int) -> dict:
    """The fidelity figures of one dtype, from the offline steps and the live runs."""
    live = {i: r["steps"] for i, r in runs[0].items()}
    ids = [str(r["id"]) for r in records]
    served = {str(r["id"]): list(r["completion_token_ids"]) for r in records}
    same_completion = [i for i in ids if runs[0][i]["completion_ids"] == served[i]]
    equal = [i for i in ids if offline.get(i) == live[i]]
    directions = [direction(offline.get(i, []), live[i]) for i in ids]
    paired = paired_difference(live, offline, n_boot, 0)
    return {
        "samples": len(ids), "equal_steps": len(equal),
        "live_completion_differs": len(ids) - len(same_completion),
        "equal_among_same_completion": len(set(equal) & set(same_completion)),
        "same_completion": len(same_completion),
        "first_difference": {side: directions.count(side) for side in ("offline", "live", "prefix")},
        "tau_offline": tau({i: offline.get(i, []) for i in ids}), "tau_live": tau(live),
        "live_minus_offline": paired["tau_mean_of_samples"],
        "live_minus_offline_token_weighted": paired["tau_token_weighted"],
        "repeats": [{"tau_live": tau({i: r["steps"] for i, r in run.items()}),
                     "samples_differing_from_first": sum(run[i]["steps"] != live[i] for i in ids)}
                    for run in runs[1:]],
        "unequal_ids": [i for i in ids if i not in equal],
    }


def table(results: dict[str, dict], seconds: dict[str, float]) -> list[str]:
    lines = ["| dtype | samples | equal step for step | live completion ≠ served | equal where live = served "
             "| first difference: offline > live / live > offline / one ends first | tau offline | tau live "
             "| live − offline (95% CI) | live reruns (tau; samples differing from run 1) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for dtype, r in results.items():
        diff, first = r["live_minus_offline"], r["first_difference"]
        reruns = "; ".join(f"{x['tau_live']:.3f}, {x['samples_differing_from_first']}" for x in r["repeats"]) or "–"
        lines.append(f"| {dtype} | {r['samples']} | {r['equal_steps']} of {r['samples']} "
                     f"| {r['live_completion_differs']} | {r['equal_among_same_completion']} of {r['same_completion']} "
                     f"| {first['offline']} / {first['live']} / {first['prefix']} | {r['tau_offline']:.3f} "
                     f"| {r['tau_live']:.3f} | {diff['difference']:+.4f} ({diff['ci95'][0]:+.4f}, "
                     f"{diff['ci95'][1]:+.4f}) | {reruns} | {seconds[dtype]:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the target's HF directory (the served one)")
    parser.add_argument("--drafter", type=Path, required=True, help="the drafter's HF directory")
    parser.add_argument("--completions", type=Path, required=True, help="the served completions (fetch's output)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backend", default="fla", choices=["fla", "torch"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--limit", type=int, help="only the first N completions (a quick check)")
    parser.add_argument("--repeats", type=int, default=1, help="live runs per dtype (run-to-run variation)")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="write the per-sample steps and every figure here")
    parser.add_argument("--record", type=Path, default=RECORD)
    args = parser.parse_args()

    records = read_completions(args.completions, need_tokens=True)[: args.limit]
    drafter = load_drafter(args.drafter)
    stops = stop_token_ids({"target": {"path": str(args.target)}, "stop_token_ids": None})
    results, seconds, detail = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        completions = work / "completions.jsonl"
        completions.write_bytes(b"".join(serialize(r) for r in records))
        for dtype in args.dtypes:
            started = time.perf_counter()
            offline = offline_steps(args, dtype, drafter, completions, work)
            runs, backend = live_runs(args, dtype, records, stops)
            seconds[dtype] = time.perf_counter() - started
            results[dtype] = compare(records, offline, runs, args.bootstrap)
            detail[dtype] = {"backend": backend, "offline": offline, "live": runs}
            print(table({dtype: results[dtype]}, seconds)[-1], flush=True)
            if args.json:  # after every dtype, so that a run stopped in the next one keeps this one
                atomic_write_json(args.json, {"results": results, "seconds": seconds, "samples": detail})
    device = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else \
        platform.processor() or "cpu"
    versions = package_versions()
    lines = [f"### {time.strftime('%Y-%m-%d')}: {device}, backend {args.backend}, {len(records)} samples of "
             f"{args.completions.name}, drafter {args.drafter.name} (block {drafter.block_size}, layers "
             f"{drafter.layer_ids}), {args.repeats} live run(s) per dtype",
             "",
             f"Live: dflash_generate with exact rollback; offline: extract + evaluate (chain-B{drafter.block_size}), "
             f"same device and dtype. Versions: "
             + ", ".join(f"{k} {versions[k]}" for k in sorted(versions))
             + f"; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}. "
             f"Command: `python benchmarks/fidelity.py {' '.join(sys.argv[1:])}`",
             ""] + table(results, seconds)
    print_and_record(lines, args.record)
    if args.json:
        atomic_write_json(args.json, {"results": results, "seconds": seconds, "samples": detail,
                                      "versions": versions, "device": device})


if __name__ == "__main__":
    main()
