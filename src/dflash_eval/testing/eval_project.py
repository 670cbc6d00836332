"""A tiny target, its completions and cached states, and demo-shaped drafter checkpoints: real evaluations in
seconds, for the start-up benchmark (benchmarks/checkpoints_startup.py) and the grouped-evaluation workflow tests.

`WORKFLOW_STAND_IN` is a `dflash-eval` for real Snakemake runs of such a project: fetch and extract copy the
prepared completions and cache (no server, no target forward), evaluate is the real command, and everything else
goes to the recorder of dflash_eval.testing.workflow."""

from __future__ import annotations

import json
import random
from pathlib import Path

DATASET = "demo-code"
LAYER_IDS = [1, 5]


def tiny_inputs(root: Path, dataset: str = DATASET) -> tuple[Path, Path]:
    """A random demo-shaped target (8 layers, hidden 32) and three completions of random tokens under `root`, laid
    out as a demo build lays them out: (target directory, completions file)."""
    from transformers import AutoTokenizer

    from dflash_eval.demo import target
    from dflash_eval.testing.fixtures import build_tokenizer

    build_tokenizer(root / "tok")
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>"]})
    config = target.config_for(
        tokenizer, hidden_size=32, intermediate_size=64, head_dim=16, linear_head_dim=16, max_position_embeddings=4096
    )
    target.save_target(target.new_model(config, 0), tokenizer, root / "resources/demo/target", {})
    rng = random.Random(0)
    records = [
        {
            "id": f"s{i}",
            "prompt_token_ids": [rng.randrange(3, 90) for _ in range(4)],
            "completion_token_ids": [rng.randrange(3, 90) for _ in range(12)],
            "completion_ids_source": "server",
            "token_check": {},
            "request": {"max_tokens": 12},
        }
        for i in range(3)
    ]
    completions = root / "results/completions" / f"{dataset}.jsonl"
    completions.parent.mkdir(parents=True)
    completions.write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "resources/demo/target", completions


def extract_tiny(root: Path, dataset: str = DATASET) -> Path:
    """`tiny_inputs`, then their states at LAYER_IDS extracted by the extract stage (CPU, torch kernels): the cache."""
    from dflash_eval.extract.stage import extract

    target, completions = tiny_inputs(root, dataset)
    cache = root / f"results/hidden/{dataset}/L{'-'.join(map(str, LAYER_IDS))}"
    extract(
        {
            "dataset": dataset,
            "layer_ids": LAYER_IDS,
            "last_layer": "final_norm",
            "server": None,
            "target": {"path": str(target), "dtype": "float32", "device": "cpu", "backend": "torch"},
        },
        completions,
        cache,
    )
    return cache


def build_checkpoints(target_dir: Path, layer_ids: list[int], count: int, out: Path, first_seed: int = 0) -> list[Path]:
    """`count` random drafters of the demo's shape for the target in `target_dir` (seeds first_seed, ...), each a
    real HF directory (the demo's own builders: demo.drafters' drafter_config and save_checkpoint)."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig, AutoTokenizer

    from dflash_eval.demo.drafters import drafter_config, save_checkpoint

    target_config = AutoConfig.from_pretrained(target_dir)
    mask_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids("<|mask|>")
    paths = []
    for seed in range(first_seed, first_seed + count):
        torch.manual_seed(seed)
        model = DFlashDraftModel(drafter_config(target_config, mask_id, layer_ids)).eval()
        save_checkpoint(model, out, f"step{seed}", seed, 0.0)
        paths.append(out / f"step{seed}")
    return paths


# {python}: the interpreter; the prepared files come from the environment (DFLASH_EVAL_TEST_COMPLETIONS: a
# folder of <dataset>.jsonl, DFLASH_EVAL_TEST_HIDDEN: a folder of <dataset>/<layerset>/)
WORKFLOW_STAND_IN = r'''#!{python}
"""dflash-eval for grouped-evaluation workflow tests: prepared fetch and extract outputs, the real evaluate."""
import os, shutil, sys
from pathlib import Path

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
command = rest[0]
if command == "evaluate":
    with open("calls.log", "a") as log:
        log.write("evaluate " + " ".join(rest[1:]) + "\n")
    os.execv(sys.executable, [sys.executable, "-c",
             "import sys; from dflash_eval.cli import entry; sys.argv[0] = 'dflash-eval'; entry()", *args])
opts = {{rest[i]: rest[i + 1] for i in range(len(rest) - 1) if rest[i].startswith("--")}}
if command in ("fetch", "extract"):
    out = Path(opts["--out"])
    with open("calls.log", "a") as log:
        log.write(f"{{command}} {{out}}\n")
    if command == "fetch":
        shutil.copyfile(Path(os.environ["DFLASH_EVAL_TEST_COMPLETIONS"]) / out.name, out)
    else:
        shutil.copytree(Path(os.environ["DFLASH_EVAL_TEST_HIDDEN"]) / out.parent.name / out.name, out)
    sys.exit(0)
os.execv(str(Path(__file__).with_name("recorder")), [str(Path(__file__).with_name("recorder")), *sys.argv[1:]])
'''


def tiny_served(root: Path) -> tuple[Path, Path, Path]:
    """A tiny random target, its completions and one drafter of the demo's layer taps under `root`: (target,
    completions, drafter). The smoke modes of the benchmarks that compare a served drafter's loops."""
    target, completions = tiny_inputs(root)
    return target, completions, build_checkpoints(target, [1, 5], 1, root / "drafters")[0]
