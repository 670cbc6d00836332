"""An evaluation job's start-up (issue 27): importing the evaluate stage, loading a drafter, one whole process.

Each figure is a fresh Python process (what one Snakemake job is), timed from outside; the median of --runs.
--src names code trees (their src/ folders) to compare, e.g. the old code's and this one's, run in turn.

    python benchmarks/startup.py --smoke                      # seconds: a tiny CPU drafter, this tree
    python benchmarks/startup.py --src OLD/src --src src --drafter resources/demo/drafters/step250 --runs 5
    python benchmarks/startup.py --src OLD/src --src src --evaluate "evaluate --settings ... --samples /tmp/s.csv"
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORT = (
    "import time; t = time.perf_counter(); import torch; a = time.perf_counter(); "
    "import dflash_eval.evaluate.stage; print(a - t, time.perf_counter() - a)"
)
LOAD = (
    "import sys, time; t = time.perf_counter(); from dflash_eval.evaluate.drafter import load_drafter; "
    "a = time.perf_counter(); load_drafter(sys.argv[1]); print(a - t, time.perf_counter() - a)"
)


def _run(src: str, argv: list[str]) -> tuple[float, str]:
    # `src` first, so its dflash_eval wins over any other on the path; the rest kept (where torch may live)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{argv[:2]} with {src}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return wall, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def tiny_drafter(root: Path) -> Path:
    """A random two-layer drafter saved as an HF directory (our module tree: no transformers needed)."""
    import json

    import torch
    from safetensors.torch import save_file

    from dflash_eval.evaluate.drafter_model import DFlashDraftModel, DrafterConfig

    config = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 0,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [0, 2]},
    }
    model = DFlashDraftModel(DrafterConfig(config))
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(root / "model.safetensors"),
        metadata={"format": "pt"},
    )
    torch.manual_seed(0)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", help="a code tree's src/ (repeat to compare; default: this one's)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--drafter", help="a checkpoint for load_drafter (default with --smoke: a tiny random one)")
    parser.add_argument("--evaluate", help="dflash-eval arguments of one whole evaluation process, timed as a whole")
    parser.add_argument("--smoke", action="store_true", help="one run each on a tiny CPU drafter (seconds)")
    args = parser.parse_args(argv)
    sources = args.src or [str(Path(__file__).resolve().parents[1] / "src")]
    runs = 1 if args.smoke else args.runs
    with tempfile.TemporaryDirectory() as tmp:
        drafter = args.drafter or (str(tiny_drafter(Path(tmp) / "drafter")) if args.smoke else None)
        rows = []
        for _ in range(runs):  # the trees in turn, run after run, so a drift of the machine's speed hits both
            for src in sources:
                _, out = _run(src, ["-c", IMPORT])
                torch_s, stage_s = map(float, out.split())
                rows.append((src, "import torch", torch_s))
                rows.append((src, "import evaluate.stage (after torch)", stage_s))
                if drafter:
                    _, out = _run(src, ["-c", LOAD, drafter])
                    rows.append((src, "load_drafter (after its import)", float(out.split()[1])))
                if args.evaluate:
                    wall, _ = _run(src, ["-m", "dflash_eval.cli", *shlex.split(args.evaluate)])
                    rows.append((src, "whole evaluate process (wall)", wall))
    print(f"{'code':40} {'what':38} {'median s':>9} {'min':>7} {'max':>7}  (n={runs})")
    for src in sources:
        for what in dict.fromkeys(w for s, w, _ in rows if s == src):
            values = [v for s, w, v in rows if s == src and w == what]
            print(f"{src[-40:]:40} {what:38} {statistics.median(values):9.3f} {min(values):7.3f} {max(values):7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
