"""Offline = the reference loop on one device, per dtype: our extract + evaluate against `dflash_generate` run live.

For each dtype, on the same device, with the same Gated DeltaNet kernels (`--backend`, verified by
extract.backends for both sides):

- offline: the extract stage (`extract.stage.extract`) caches the target's states of the served
  completions, and the evaluate stage (`evaluate.stage.run_evaluation`) scores the drafter's own-block
  chain on them: what the workflow computes;
- live: `dflash.model.dflash_generate` (temperature 0) with the same target and drafter loaded in that
  dtype, with exact cache rollback (dflash_eval/demo/reference.py: transformers' crop does not rewind the
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
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.completions import read_completions, serialize
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.stage import stop_token_ids
from dflash_eval.extract.backends import package_versions, use_backend
from dflash_eval.extract.target import load_target, parse_dtype
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.methods import chain_method
from dflash_eval.stats import paired_difference
from dflash_eval.testing.offline import extract_and_evaluate

ROOT = Path(__file__).resolve().parents[1]
from dflash_eval.demo.reference import first_difference, run_reference_loop

RECORD = ROOT / "benchmarks" / "results" / "fidelity.md"
DTYPES = ("float32", "bfloat16")


def offline_steps(args: argparse.Namespace, dtype: str, drafter, completions: Path, work: Path) -> dict[str, list[int]]:
    """The workflow's own numbers: extract the served completions' states, evaluate the drafter's own chain."""
    target = {"path": str(args.target), "dtype": dtype, "device": args.device, "backend": args.backend}
    # rows: one dict per sample and method
    _, rows = extract_and_evaluate(target, args.drafter, drafter, completions, work / f"hidden-{dtype}", "fidelity")
    chain = chain_method(drafter.block_size)
    return {
        str(row["id"]): [int(x) for x in str(row["acceptance_lengths"]).split()]
        for row in rows
        if row["method"] == chain
    }


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
                steps, ids = run_reference_loop(drafter, target, prompt, int(record["request"]["max_tokens"]), stops)
                run[str(record["id"])] = {"steps": steps, "completion_ids": ids[len(prompt) :]}
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


def _interval(paired: dict) -> str:
    d = paired["tau_mean_of_samples"]
    if math.isnan(d["difference"]):
        return "–"
    return f"{d['difference']:+.4f} ({d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f})"


def compare(records: list[dict], offline: dict[str, list[int]], runs: list[dict], n_boot: int) -> dict:
    """The fidelity figures of one dtype, from the offline steps and the live runs."""
    live = {i: r["steps"] for i, r in runs[0].items()}
    ids = [str(r["id"]) for r in records]
    served = {str(r["id"]): list(r["completion_token_ids"]) for r in records}
    same = [i for i in ids if runs[0][i]["completion_ids"] == served[i]]
    drifted = [i for i in ids if i not in same]
    equal = [i for i in ids if offline.get(i) == live[i]]
    directions = {i: direction(offline.get(i, []), live[i]) for i in ids}

    def paired(subset: list[str]) -> dict:
        return paired_difference({i: live[i] for i in subset}, {i: offline.get(i, []) for i in subset}, n_boot, 0)

    def sides(subset: list[str]) -> dict[str, int]:
        return {side: sum(directions[i] == side for i in subset) for side in ("offline", "live", "prefix")}

    return {
        "samples": len(ids),
        "equal_steps": len(equal),
        "live_completion_differs": len(drifted),
        "same_completion": len(same),
        "equal_among_same_completion": len(set(equal) & set(same)),
        "first_difference": sides(ids),
        "first_difference_same_completion": sides(same),
        "first_difference_drifted": sides(drifted),
        "tau_offline": tau({i: offline.get(i, []) for i in ids}),
        "tau_live": tau(live),
        "live_minus_offline": paired(ids),
        "live_minus_offline_same_completion": paired(same),
        "live_minus_offline_drifted": paired(drifted),
        "repeats": [
            {
                "tau_live": tau({i: r["steps"] for i, r in run.items()}),
                "samples_differing_from_first": sum(run[i]["steps"] != live[i] for i in ids),
            }
            for run in runs[1:]
        ],
        "unequal_ids": [i for i in ids if i not in equal],
        "drifted_ids": drifted,
    }


def table(results: dict[str, dict], seconds: dict[str, float]) -> list[str]:
    """One row per dtype; then the same split by whether the live completion is the served one."""
    lines = [
        "| dtype | samples | equal step for step | live completion ≠ served | first difference: offline > live "
        "/ live > offline / one ends first | tau offline | tau live | live − offline (95% CI) "
        "| live reruns (tau; samples differing from run 1) | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for dtype, r in results.items():
        first = r["first_difference"]
        reruns = "; ".join(f"{x['tau_live']:.3f}, {x['samples_differing_from_first']}" for x in r["repeats"]) or "–"
        lines.append(
            f"| {dtype} | {r['samples']} | {r['equal_steps']} of {r['samples']} "
            f"| {r['live_completion_differs']} | {first['offline']} / {first['live']} / {first['prefix']} "
            f"| {r['tau_offline']:.3f} | {r['tau_live']:.3f} | {_interval(r['live_minus_offline'])} "
            f"| {reruns} | {seconds[dtype]:.0f} |"
        )
    lines += [
        "",
        "| dtype | live completion | samples | equal step for step | first difference: offline > live / "
        "live > offline / one ends first | live − offline (95% CI) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype, r in results.items():
        for label, key, count, equal in (
            ("= served", "same_completion", r["same_completion"], r["equal_among_same_completion"]),
            ("≠ served", "drifted", r["live_completion_differs"], r["equal_steps"] - r["equal_among_same_completion"]),
        ):
            first = r[f"first_difference_{key}"]
            lines.append(
                f"| {dtype} | {label} | {count} | {equal} of {count} | {first['offline']} / {first['live']} / "
                f"{first['prefix']} | {_interval(r[f'live_minus_offline_{key}'])} |"
            )
    return lines


def header(meta: dict, records: int, drafter, versions: dict) -> list[str]:
    return [
        f"### {meta['date']}: {meta['device']}, backend {meta['backend']}, {records} samples of "
        f"{meta['completions']}, drafter {meta['drafter']} (block {drafter.block_size}, layers "
        f"{drafter.layer_ids}), {meta['repeats']} live run(s) per dtype",
        "",
        f"Live: dflash_generate with exact rollback; offline: extract + evaluate (chain-B{drafter.block_size}), "
        f"same device and dtype. Versions: "
        + ", ".join(f"{k} {versions[k]}" for k in sorted(versions))
        + f"; {meta['tf32']}. Command: `{meta['command']}`",
        "",
    ]


def measure(args: argparse.Namespace, records: list[dict], drafter) -> dict:
    """Offline and live on this machine, per dtype; the saved form (--json) that --from-json re-scores."""
    stops = stop_token_ids({"target": {"path": str(args.target)}, "stop_token_ids": None})
    device = (
        torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else platform.processor() or "cpu"
    )
    saved = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "device": device,
            "backend": args.backend,
            "completions": args.completions.name,
            "drafter": args.drafter.name,
            "repeats": args.repeats,
            "tf32": f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}",
            "command": f"python benchmarks/fidelity.py {' '.join(sys.argv[1:])}",
        },
        "versions": package_versions(),
        "seconds": {},
        "samples": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        completions = work / "completions.jsonl"
        completions.write_bytes(b"".join(serialize(r) for r in records))
        for dtype in args.dtypes:
            started = time.perf_counter()
            offline = offline_steps(args, dtype, drafter, completions, work)
            runs, backend = live_runs(args, dtype, records, stops)
            saved["seconds"][dtype] = time.perf_counter() - started
            saved["samples"][dtype] = {"backend": backend, "offline": offline, "live": runs}
            result = compare(records, offline, runs, args.bootstrap)
            print(table({dtype: result}, saved["seconds"])[2], flush=True)
            if args.json:  # after every dtype, so that a run stopped in the next one keeps this one
                atomic_write_json(args.json, saved)
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    needed = "--smoke" not in sys.argv  # --smoke builds its own tiny inputs
    parser.add_argument("--target", type=Path, required=needed, help="the target's HF directory (the served one)")
    parser.add_argument("--drafter", type=Path, required=needed, help="the drafter's HF directory")
    parser.add_argument("--completions", type=Path, required=needed, help="the served completions (fetch's output)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backend", default="fla", choices=["fla", "torch"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--limit", type=int, help="only the first N completions (a quick check)")
    parser.add_argument("--repeats", type=int, default=1, help="live runs per dtype (run-to-run variation)")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="write the per-sample steps and the run's facts here")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="re-score a run saved with --json (no model runs): the same tables from its samples",
    )
    parser.add_argument("--record", type=Path, default=RECORD)
    # both sides on a tiny random target and drafter on the CPU (torch kernels), fp32: the code path, not the figures
    smoke_mode(parser, device="cpu", backend="torch", dtypes=["float32"], bootstrap=50, record=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from dflash_eval.testing.eval_project import tiny_served

            args.target, args.completions, args.drafter = tiny_served(Path(tmp))
        run(args)


def run(args: argparse.Namespace) -> None:
    """Measure (or re-score `--from-json`), print and record."""
    records = read_completions(args.completions, need_tokens=True)[: args.limit]
    drafter = load_drafter(args.drafter)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        saved["meta"]["command"] += f" (re-scored: python benchmarks/fidelity.py {' '.join(sys.argv[1:])})"
    else:
        saved = measure(args, records, drafter)
    results = {
        dtype: compare(records, saved["samples"][dtype]["offline"], saved["samples"][dtype]["live"], args.bootstrap)
        for dtype in DTYPES
        if dtype in saved["samples"]
    }
    print_and_record(
        header(saved["meta"], len(records), drafter, saved["versions"]) + table(results, saved["seconds"]), args.record
    )
    if args.json:
        atomic_write_json(args.json, {**saved, "results": results})


if __name__ == "__main__":
    main()
