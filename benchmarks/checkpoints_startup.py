"""Wall time per checkpoint of a training run's evaluation (issue 27): one `dflash-eval evaluate` process per
checkpoint (`evaluation.checkpoints_per_job: 1`, the default), code trees compared in alternating pairs; the same
checkpoints in one grouped process (`--member` x N, what `checkpoints_per_job: N` runs), then that process again
with every result in its store (a rerun that changed nothing); and the parts of one evaluate process.

Checkpoints: `--checkpoints` random drafters of the demo's shape (testing/eval_project.py's build_checkpoints: each a
real HF directory with model.safetensors; copies of the demo's drafters would do, these are seeded random ones of the
same shape), evaluated on a finished demo build's cached states and completions (`--demo`, a directory holding
config.yaml, resources/demo/ and results/: only read; outputs go to a temporary directory) with the demo config's
evaluation settings, computed by each tree's own config module. Each process is the console script's entry point
(`dflash_eval.cli.entry`) timed from outside, so it includes Python's start, every import and the evaluation. Pair
i runs checkpoint i under each tree, the order of the trees swapped every pair, so a drift of a shared machine's
load hits both alike. Every tree's samples.csv, and the grouped process's, is compared with the first tree's.

The parts of one evaluate process (`--phases`, the last tree, the first checkpoint), each timed in a fresh process
in the order an evaluation meets them: the interpreter's start and `import torch`, our imports (the CLI and the
evaluate stage), the settings' validation and CUDA's initialisation (the first tensor on the device), the GPU claim, reading the checkpoint
(drafter and the target's head), reading the cache (every sample, sha256-checked), the evaluation
(`run_evaluation`, which reads both again, now warm), writing the outputs, and the exit.

    python benchmarks/checkpoints_startup.py --demo /tmp/demo --src /tmp/old/src --src src --checkpoints 20
    python benchmarks/checkpoints_startup.py --tiny --checkpoints 20 --device cuda   # no demo build: tiny inputs
    python benchmarks/checkpoints_startup.py --smoke       # seconds: a tiny target, cache and two checkpoints

Prints a table and appends it to benchmarks/results/startup.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.testing import eval_project

ROOT = Path(__file__).resolve().parents[1]
DATASET = "demo-code"
# Run in each tree: its own config module turns the config into each drafter's evaluate settings (JSON).
# (the builder lives in evaluate/settings.py since the config split, in config.py before it)
SETTINGS = (
    "import json, sys\nfrom dflash_eval import config as c\n"
    "try:\n    from dflash_eval.evaluate.settings import evaluate_settings as build\n"
    "except ImportError:\n    build = c.evaluate_settings\n"
    "cfg = c.validate_config(json.load(open(sys.argv[1])))\n"
    "print(json.dumps({d: c.settings_json(build(cfg, d, sys.argv[2])) for d in cfg['drafters']}))"
)
ENTRY = "import sys; from dflash_eval.cli import entry; sys.argv[0] = 'dflash-eval'; entry()"
# The parts of one evaluate process, in the order an evaluation meets them; prints {part: seconds} as JSON. argv:
# the process's start time (time.time() taken outside, just before it was started), then the evaluate arguments.
PHASES = """
import time
t = [float(__import__('sys').argv[1]), time.time()]
import json, sys
import torch
t.append(time.time())
from dflash_eval import cli
from dflash_eval.evaluate import stage
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.evaluate.target_head import load_target_head
from dflash_eval.cache.store import HiddenCache
from dflash_eval.config import settings_from_args
from dflash_eval.evaluate.settings import evaluate_settings
t.append(time.time())
args = cli.build_parser(only='evaluate').parse_args(sys.argv[2:])
settings = settings_from_args(args, evaluate_settings)
device = torch.device(settings['device'])
if device.type == 'cuda':
    torch.zeros(1, device=device); torch.cuda.synchronize()
t.append(time.time())
device = stage.claim_settings_device(settings, None, 'phases')
t.append(time.time())
head = load_target_head(settings['target']['path']); c = settings['checkpoint']
load_drafter(c['path'], c['layout'], c.get('config'), c['layer_ids'], c['allow_pickle'], vocab_size=head.embed.shape[0])
t.append(time.time())
cache = HiddenCache(args.hidden, verify=True)
for entry in cache.samples:
    cache.load_sample(str(entry['id']), cache.layer_ids)
cache.verified()
t.append(time.time())
metrics, rows = stage.run_evaluation(settings, args.hidden, args.completions, device=device)
if device.type == 'cuda':
    torch.cuda.synchronize()
t.append(time.time())
stage.write_outputs(metrics, rows, args.metrics, args.samples)
t.append(time.time())
names = ['interpreter start', 'import torch', 'our imports (cli, evaluate stage)', 'settings + CUDA init (first tensor; none on cpu)',
         'GPU claim', 'read checkpoint (drafter + target head)', 'read cache (all samples, sha256)',
         'evaluation (run_evaluation, reads again)', 'write outputs']
print(json.dumps({'parts': dict(zip(names, [b - a for a, b in zip(t, t[1:])])), 'end': t[-1]}))
import gc; gc.freeze()
"""
PARTS_BOUND = ("our imports (cli, evaluate stage)", "settings + CUDA init (first tensor; none on cpu)", "GPU claim")


def tiny_demo(root: Path) -> Path:
    """A seconds-fast stand-in for a finished demo build: testing/eval_project.py's tiny target, completions and their
    extracted states, and a config.yaml naming them."""
    eval_project.extract_tiny(root, DATASET)
    prompts = root / "resources/prompts/demo_code.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text(json.dumps({"id": "s0", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    import yaml

    (root / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "demo": {"enabled": False},
                "target": {"path": "resources/demo/target", "dtype": "float32", "device": "cpu", "backend": "torch"},
                "server": {
                    "kind": "external",
                    "base_url": "http://127.0.0.1:9",
                    "start_command": "false",
                    "stop_command": "true",
                },
                "fetch": {"max_tokens": 12},
                "datasets": {DATASET: {"prompts": str(prompts.relative_to(root))}},
                "extraction": {},
                "report": {},
                "evaluation": {"bootstrap": 10, "ddtree_budgets": [8], "block_sizes": [8], "topk": [1]},
                "drafters": {},
            }
        )
    )
    return root


def demo_config(demo: Path, checkpoints: list[Path], device: str | None) -> dict:
    """The demo's config.yaml with its drafters replaced by `checkpoints` (absolute paths), as plain data."""
    import yaml

    config = yaml.safe_load((demo / "config.yaml").read_text())
    config["drafters"] = {
        f"ck{i:02d}": {"path": str(p), "layer_ids": [1, 5], "trained_with": "torch", "step": i}
        for i, p in enumerate(checkpoints)
    }
    config.setdefault("report", {})["served_drafter"] = None
    if device:
        config.setdefault("evaluation", {})["device"] = device
    return config


def run(src: str, argv: list[str], cwd: Path) -> tuple[float, str]:
    """Wall seconds and stdout of one fresh Python process with `src` as the package's tree."""
    # `src` first, so its dflash_eval wins over any other on the path; the rest kept (where torch may live)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(src).resolve()), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{argv[:2]} with {src}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return wall, done.stdout


def evaluate_argv(settings: str, demo: Path, out: Path) -> list[str]:
    """The evaluate rule's command line (workflow/rules/evaluate.smk), outputs under `out` (made, as Snakemake
    makes an output's and a log's directory)."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        "--log",
        str(out / "log"),
        "evaluate",
        "--settings",
        settings,
        "--hidden",
        str(demo / f"results/hidden/{DATASET}/L1-5"),
        "--completions",
        str(demo / f"results/completions/{DATASET}.jsonl"),
        "--metrics",
        str(out / "metrics.json"),
        "--samples",
        str(out / "samples.csv"),
    ]


def grouped_argv(settings: dict[str, str], demo: Path, out: Path, store: Path) -> list[str]:
    """The grouped evaluate rule's command line (evaluation.checkpoints_per_job: all of them in one job)."""
    members = []
    for name, text in settings.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        members.append(
            json.dumps(
                {
                    "settings": json.loads(text),
                    "metrics": str(out / name / "metrics.json"),
                    "samples": str(out / name / "samples.csv"),
                }
            )
        )
    return [
        "--log",
        str(out / "log"),
        "evaluate",
        "--member",
        *members,
        "--hidden",
        str(demo / f"results/hidden/{DATASET}/L1-5"),
        "--completions",
        str(demo / f"results/completions/{DATASET}.jsonl"),
        "--store",
        str(store),
    ]


def logged_seconds(log: Path, word: str) -> list[float]:
    """Per-checkpoint seconds from a grouped process's log ('...: evaluated in 1.23 s')."""
    return [
        float(line.rsplit(f"{word} in ", 1)[1].split()[0])
        for line in log.read_text().splitlines()
        if f"): {word} in " in line
    ]


def phases(src: str, argv: list[str], cwd: Path) -> dict[str, float]:
    """The parts of one evaluate process (PHASES), the exit timed from outside."""
    started = time.time()
    _, stdout = run(src, ["-c", PHASES, repr(started), *argv], cwd)
    ended = time.time()
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result["parts"], "exit": ended - result["end"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT, help="a finished demo build (read only)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny inputs instead of a demo build (as --smoke, at "
        "full counts): start-up, not the evaluation, is measured",
    )
    parser.add_argument("--src", action="append", help="a code tree's src/ (repeat to compare; default: this one's)")
    parser.add_argument("--checkpoints", type=int, default=20)
    parser.add_argument("--device", help="evaluation.device (default: the demo config's)")
    parser.add_argument(
        "--grouped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also evaluate all checkpoints in one grouped process, then again from its store (the last tree)",
    )
    parser.add_argument(
        "--phases",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the parts of one evaluate process (the last tree)",
    )
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks" / "results" / "startup.md")
    smoke_mode(parser, checkpoints=2, record=None)
    args = parser.parse_args()
    sources = args.src or [str(ROOT / "src")]
    with tempfile.TemporaryDirectory(prefix="checkpoints-startup-") as tmp:
        work = Path(tmp)
        demo = tiny_demo(work / "demo") if args.smoke or args.tiny else args.demo.resolve()
        checkpoints = eval_project.build_checkpoints(
            demo / "resources/demo/target", [1, 5], args.checkpoints, work / "ckpt"
        )
        config_file = work / "config.json"
        config = demo_config(demo, checkpoints, args.device)
        config_file.write_text(json.dumps(config))
        device = config.get("evaluation", {}).get("device", "cpu")
        settings = {src: json.loads(run(src, ["-c", SETTINGS, str(config_file), DATASET], demo)[1]) for src in sources}
        names = list(settings[sources[0]])
        parts = (
            phases(sources[-1], evaluate_argv(settings[sources[-1]][names[0]], demo, work / "phases")[2:], demo)
            if args.phases
            else None
        )
        walls: dict[str, list[float]] = {src: [] for src in sources}
        for i, name in enumerate(names):
            for src in sources if i % 2 == 0 else sources[::-1]:
                out = work / "out" / str(sources.index(src)) / name
                walls[src].append(run(src, ["-c", ENTRY, *evaluate_argv(settings[src][name], demo, out)], demo)[0])
        differing = [
            name
            for name in names
            for k in range(1, len(sources))
            if not filecmp.cmp(
                work / "out/0" / name / "samples.csv", work / "out" / str(k) / name / "samples.csv", shallow=False
            )
        ]
        grouped = None
        if args.grouped:
            last = settings[sources[-1]]
            first, _ = run(sources[-1], ["-c", ENTRY, *grouped_argv(last, demo, work / "g1", work / "store")], demo)
            again, _ = run(sources[-1], ["-c", ENTRY, *grouped_argv(last, demo, work / "g2", work / "store")], demo)
            equal = {
                f: sum(
                    filecmp.cmp(work / "out" / str(len(sources) - 1) / n / f, work / g / n / f, shallow=False)
                    for n in names
                    for g in ("g1", "g2")
                )
                for f in ("samples.csv", "metrics.json")
            }
            grouped = {
                "wall": first,
                "each": logged_seconds(work / "g1/log", "evaluated"),
                "again": again,
                "restored": sum("): restored from" in line for line in (work / "g2/log").read_text().splitlines()),
                "equal": equal,
            }
    load = os.getloadavg()
    lines = [
        f"## {len(names)} checkpoints, one evaluate process each: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs visible, evaluation on {device}, load average {load[0]:.1f} at the end; "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"`python benchmarks/checkpoints_startup.py {' '.join(sys.argv[1:])}`",
        "",
        "| code | per-checkpoint wall s, median | min | max | total s |",
        "|---|---:|---:|---:|---:|",
    ]
    for src in sources:
        w = walls[src]
        lines.append(f"| {src} | **{statistics.median(w):.2f}** | {min(w):.2f} | {max(w):.2f} | {sum(w):.1f} |")
    if len(sources) > 1:
        ratios = [b / a for a, b in zip(walls[sources[0]], walls[sources[-1]], strict=True)]
        lines += [
            "",
            f"{sources[-1]} / {sources[0]}, pair by pair: median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}); samples.csv equal to the first tree's for "
            f"{len(names) * (len(sources) - 1) - len(differing)} of {len(names) * (len(sources) - 1)}"
            + (f" (differing: {', '.join(differing)})" if differing else ""),
        ]
    if grouped:
        each, own = grouped["each"], walls[sources[-1]]
        lines += [
            "",
            f"Grouped (`checkpoints_per_job: {len(names)}`, one `evaluate --member` process, {sources[-1]}): "
            f"whole process {grouped['wall']:.1f} s = **{grouped['wall'] / len(names):.2f} s per checkpoint** "
            f"against {statistics.median(own):.2f} s (median) one process each, {sum(own) / grouped['wall']:.1f}x "
            f"less in total; per checkpoint inside it median {statistics.median(each):.2f} s (first {each[0]:.2f}, "
            f"min {min(each):.2f}, max {max(each):.2f}). Again with all {grouped['restored']} in its store (a "
            f"rerun that changed nothing): {grouped['again']:.1f} s. Equal byte for byte to the one-process-each outputs, "
            f"over both grouped runs: samples.csv {grouped['equal']['samples.csv']} of {2 * len(names)}, "
            f"metrics.json {grouped['equal']['metrics.json']} of {2 * len(names)} (on CUDA its drafter timings "
            "differ run to run)",
        ]
    if parts:
        bound = sum(parts[k] for k in PARTS_BOUND)
        lines += [
            "",
            f"The parts of one evaluate process ({names[0]}, {sources[-1]}, each a fresh process):",
            "",
            "| part | seconds |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v:.3f} |" for k, v in parts.items()]
        lines += [
            f"| **total** | **{sum(parts.values()):.3f}** |",
            "",
            f"Start-up beyond `import torch` ({', '.join(PARTS_BOUND)}): **{bound:.2f} s** (the issue's bound on "
            "a GPU machine: 2 s)",
        ]
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
