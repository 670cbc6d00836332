"""Wall time per checkpoint of a training run's evaluation (issue 27): one `dflash-eval evaluate` process per
checkpoint, as the workflow runs them, code trees compared in alternating pairs; and the same checkpoints in one
process, which is what several checkpoints per evaluation job could save at most.

Checkpoints: `--checkpoints` random drafters of the demo's shape (the demo's own builders: demo.drafters'
drafter_config and save_checkpoint, so each is a real HF directory with model.safetensors), evaluated on a finished
demo build's cached states and completions (`--demo`, a directory holding config.yaml, resources/demo/ and results/:
only read; outputs go to a temporary directory) with the demo config's evaluation settings, computed by each tree's
own config module. Each process is the console script's entry point (`dflash_eval.cli.entry`) timed from outside,
so it includes Python's start, every import and the evaluation. Pair i runs checkpoint i under each tree, the
order of the trees swapped every pair, so a drift of a shared machine's load hits both alike. Every tree's
samples.csv is compared with the first tree's (the same evaluation, only its start-up differs). `--in-process`
evaluates the checkpoints once more with the first `--src` tree, all in one process (cli.main per checkpoint).

    python benchmarks/checkpoints_startup.py --demo /tmp/demo --src /tmp/old/src --src src --checkpoints 20
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

ROOT = Path(__file__).resolve().parents[1]
DATASET = "demo-code"
# Run in each tree: its own config module turns the config into each drafter's evaluate settings (JSON).
SETTINGS = ("import json, sys; from dflash_eval import config as c; cfg = c.validate_config(json.load(open(sys.argv[1])));"
            " print(json.dumps({d: c.settings_json(c.evaluate_settings(cfg, d, sys.argv[2])) for d in cfg['drafters']}))")
ENTRY = "import sys; from dflash_eval.cli import entry; sys.argv[0] = 'dflash-eval'; entry()"
# Several checkpoints in one process: cli.main per checkpoint, each timed; prints the seconds as JSON. Each
# evaluation on cuda holds its GPU's lock for the life of the process (evaluate/gpu.py), so a second one in the same
# process would wait for it forever: the locks are let go between checkpoints, as a multi-checkpoint job would.
IN_PROCESS = ("import json, sys, time; t0 = time.perf_counter(); from dflash_eval.cli import main; jobs = json.load(open(sys.argv[1]));"
              " first = time.perf_counter() - t0; out = []\n"
              "from dflash_eval.evaluate import gpu\n"
              "for argv in jobs:\n"
              "    t = time.perf_counter(); assert main(argv) == 0; out.append(time.perf_counter() - t)\n"
              "    [h.close() for h in gpu._held]; gpu._held.clear()\n"
              "print(json.dumps({'import': first, 'each': out}))")


def build_checkpoints(target_dir: Path, layer_ids: list[int], count: int, out: Path) -> list[Path]:
    """`count` random drafters of the demo's shape for the target in `target_dir` (seeds 0..count-1)."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig, AutoTokenizer

    from dflash_eval.demo.drafters import drafter_config, save_checkpoint

    target_config = AutoConfig.from_pretrained(target_dir)
    mask_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids("<|mask|>")
    paths = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = DFlashDraftModel(drafter_config(target_config, mask_id, layer_ids)).eval()
        save_checkpoint(model, out, f"step{seed}", seed, 0.0)
        paths.append(out / f"step{seed}")
    return paths


def tiny_inputs(root: Path) -> tuple[Path, Path]:
    """A random demo-shaped target (8 layers, hidden 32) and three completions of random tokens under `root`, laid
    out as a demo build lays them out: (target directory, completions file). Seconds; for the smoke modes."""
    import random

    from transformers import AutoTokenizer

    from dflash_eval.bench.fixtures import build_tokenizer
    from dflash_eval.demo import target

    build_tokenizer(root / "tok")
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>"]})
    config = target.config_for(tokenizer, hidden_size=32, intermediate_size=64, head_dim=16, linear_head_dim=16,
                               max_position_embeddings=4096)
    target.save_target(target.new_model(config, 0), tokenizer, root / "resources/demo/target", {})
    rng = random.Random(0)
    records = [{"id": f"s{i}", "prompt_token_ids": [rng.randrange(3, 90) for _ in range(4)],
                "completion_token_ids": [rng.randrange(3, 90) for _ in range(12)],
                "completion_ids_source": "server", "token_check": {}, "request": {"max_tokens": 12}}
               for i in range(3)]
    completions = root / "results/completions" / f"{DATASET}.jsonl"
    completions.parent.mkdir(parents=True)
    completions.write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "resources/demo/target", completions


def tiny_demo(root: Path) -> Path:
    """A seconds-fast stand-in for a finished demo build: `tiny_inputs`, their states extracted by the extract stage,
    and a config.yaml naming them."""
    from dflash_eval.extract.stage import extract

    _, completions = tiny_inputs(root)
    extract({"dataset": DATASET, "layer_ids": [1, 5], "last_layer": "final_norm", "server": None,
             "target": {"path": str(root / "resources/demo/target"), "dtype": "float32", "device": "cpu",
                        "backend": "torch"}}, completions, root / f"results/hidden/{DATASET}/L1-5")
    prompts = root / "resources/prompts/demo_code.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text(json.dumps({"id": "s0", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    import yaml

    (root / "config.yaml").write_text(yaml.safe_dump({
        "demo": {"enabled": False}, "target": {"path": "resources/demo/target", "dtype": "float32", "device": "cpu",
                                               "backend": "torch"},
        "server": {"kind": "external", "base_url": "http://127.0.0.1:9", "start_command": "false",
                   "stop_command": "true"},
        "fetch": {"max_tokens": 12}, "datasets": {DATASET: {"prompts": str(prompts.relative_to(root))}},
        "extraction": {}, "report": {},
        "evaluation": {"bootstrap": 10, "ddtree_budgets": [8], "block_sizes": [8], "topk": [1]}, "drafters": {}}))
    return root


def demo_config(demo: Path, checkpoints: list[Path], device: str | None) -> dict:
    """The demo's config.yaml with its drafters replaced by `checkpoints` (absolute paths), as plain data."""
    import yaml

    config = yaml.safe_load((demo / "config.yaml").read_text())
    config["drafters"] = {f"ck{i:02d}": {"path": str(p), "layer_ids": [1, 5], "trained_with": "torch", "step": i}
                          for i, p in enumerate(checkpoints)}
    config.setdefault("report", {})["served_drafter"] = None
    if device:
        config.setdefault("evaluation", {})["device"] = device
    return config


def run(src: str, argv: list[str], cwd: Path) -> tuple[float, str]:
    """Wall seconds and stdout of one fresh Python process with `src` as the package's tree."""
    # `src` first, so its dflash_eval wins over any other on the path; the rest kept (where torch may live)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), str(ROOT / "benchmarks"),
                                                        os.environ.get("PYTHONPATH", "")])}
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
    return ["--log", str(out / "log"), "evaluate", "--settings", settings,
            "--hidden", str(demo / f"results/hidden/{DATASET}/L1-5"),
            "--completions", str(demo / f"results/completions/{DATASET}.jsonl"),
            "--metrics", str(out / "metrics.json"), "--samples", str(out / "samples.csv")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT, help="a finished demo build (read only)")
    parser.add_argument("--src", action="append", help="a code tree's src/ (repeat to compare; default: this one's)")
    parser.add_argument("--checkpoints", type=int, default=20)
    parser.add_argument("--device", help="evaluation.device (default: the demo config's)")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                        help="also evaluate all checkpoints in one process (the last tree)")
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks" / "results" / "startup.md")
    smoke_mode(parser, checkpoints=2, record=None)
    args = parser.parse_args()
    sources = args.src or [str(ROOT / "src")]
    with tempfile.TemporaryDirectory(prefix="checkpoints-startup-") as tmp:
        work = Path(tmp)
        demo = tiny_demo(work / "demo") if args.smoke else args.demo.resolve()
        checkpoints = build_checkpoints(demo / "resources/demo/target", [1, 5], args.checkpoints, work / "ckpt")
        config_file = work / "config.json"
        config = demo_config(demo, checkpoints, args.device)
        config_file.write_text(json.dumps(config))
        device = config.get("evaluation", {}).get("device", "cpu")
        settings = {src: json.loads(run(src, ["-c", SETTINGS, str(config_file), DATASET], demo)[1]) for src in sources}
        names = list(settings[sources[0]])
        walls: dict[str, list[float]] = {src: [] for src in sources}
        for i, name in enumerate(names):
            for src in sources if i % 2 == 0 else sources[::-1]:
                out = work / "out" / str(sources.index(src)) / name
                walls[src].append(run(src, ["-c", ENTRY, *evaluate_argv(settings[src][name], demo, out)], demo)[0])
        differing = [name for name in names for k in range(1, len(sources))
                     if not filecmp.cmp(work / "out/0" / name / "samples.csv", work / "out" / str(k) / name
                                        / "samples.csv", shallow=False)]
        in_process = None
        if args.in_process:
            jobs = work / "jobs.json"
            jobs.write_text(json.dumps([evaluate_argv(settings[sources[-1]][n], demo, work / "in" / n) for n in names]))
            wall, stdout = run(sources[-1], ["-c", IN_PROCESS, str(jobs)], demo)
            in_process = {**json.loads(stdout.strip().splitlines()[-1]), "wall": wall}
    load = os.getloadavg()
    lines = [f"## {len(names)} checkpoints, one evaluate process each: {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs visible, evaluation on {device}, load average {load[0]:.1f} at the end; "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             f"`python benchmarks/checkpoints_startup.py {' '.join(sys.argv[1:])}`", "",
             "| code | per-checkpoint wall s, median | min | max | total s |", "|---|---:|---:|---:|---:|"]
    for src in sources:
        w = walls[src]
        lines.append(f"| {src} | **{statistics.median(w):.2f}** | {min(w):.2f} | {max(w):.2f} | {sum(w):.1f} |")
    if len(sources) > 1:
        ratios = [b / a for a, b in zip(walls[sources[0]], walls[sources[-1]])]
        lines += ["", f"{sources[-1]} / {sources[0]}, pair by pair: median {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}); samples.csv equal to the first tree's for "
                  f"{len(names) * (len(sources) - 1) - len(differing)} of {len(names) * (len(sources) - 1)}"
                  + (f" (differing: {', '.join(differing)})" if differing else "")]
    if in_process:
        each = in_process["each"]
        lines += ["", f"The same {len(names)} in one process ({sources[-1]}): imports {in_process['import']:.2f} s once, "
                  f"then per checkpoint median {statistics.median(each):.2f} s (first {each[0]:.2f}, "
                  f"min {min(each):.2f}, max {max(each):.2f}); whole process {in_process['wall']:.1f} s against "
                  f"{sum(walls[sources[-1]]):.1f} s for one process each: start-up share "
                  f"{1 - statistics.median(each) / statistics.median(walls[sources[-1]]):.0%} of a one-process job"]
    print_and_record(lines, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
