"""evaluation.checkpoints_per_job: several checkpoints per evaluate job and process, with every guarantee of one
job per checkpoint kept (issue 27). Real Snakemake runs of a tiny project whose evaluations are real (the
evaluate command itself, on a tiny target's extracted states); fetch and extract copy prepared outputs
(dflash_eval.testing.eval_project's stand-in)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_eval.testing import eval_project
from dflash_eval.testing.workflow import check, snakemake
from tests.support.checkout import copy_workflow_with_stand_in

DATASET = eval_project.DATASET
DRAFTERS = ["c0", "c1", "c2"]
OUTPUTS = [f"results/eval/{d}/{DATASET}/{f}" for d in DRAFTERS for f in ("metrics.json", "samples.csv")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The prepared completions and cache, a tiny target and four checkpoints (the fourth: another c1)."""
    root = tmp_path_factory.mktemp("grouped")
    prep = root / "prep"
    eval_project.extract_tiny(prep)
    checkpoints = eval_project.build_checkpoints(
        prep / "resources/demo/target", eval_project.LAYER_IDS, 4, prep / "ckpt"
    )
    workflow = copy_workflow_with_stand_in(root / "workflow", eval_project.WORKFLOW_STAND_IN)
    env = {
        "DFLASH_EVAL_TEST_COMPLETIONS": str(prep / "results/completions"),
        "DFLASH_EVAL_TEST_HIDDEN": str(prep / "results/hidden"),
    }
    return workflow, prep, checkpoints, env


def project(prepared, root: Path, per_job: int) -> Path:
    workflow, prep, checkpoints, _ = prepared
    shutil.copytree(prep / "resources/demo/target", root / "target")
    for name, path in zip(DRAFTERS, checkpoints, strict=False):
        shutil.copytree(path, root / "ckpt" / name)
    (root / "prompts.jsonl").write_text(json.dumps({"id": "s0", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    config = {
        "target": {"path": "target", "device": "cpu", "dtype": "float32", "backend": "torch"},
        "server": {"kind": "managed", "base_url": "http://127.0.0.1:9", "command": "true"},
        "fetch": {"max_tokens": 12},
        "datasets": {DATASET: {"prompts": "prompts.jsonl"}},
        "extraction": {},
        "evaluation": {"bootstrap": 10, "ddtree_budgets": [8], "topk": [1], "checkpoints_per_job": per_job},
        "drafters": {
            name: {"path": f"ckpt/{name}", "layer_ids": eval_project.LAYER_IDS, "trained_with": "torch"}
            for name in DRAFTERS
        },
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def run(prepared, root: Path, *args: str):
    workflow, _, _, env = prepared
    return snakemake(workflow, root, *args, env=env)


def outputs(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in OUTPUTS}


def job_log(root: Path) -> str:
    return (root / f"results/logs/evaluate/group-c0/{DATASET}.log").read_text()


@pytest.fixture(scope="module")
def grouped(prepared, tmp_path_factory):
    """A finished grouped run (all three checkpoints in one job), to copy per test."""
    root = project(prepared, tmp_path_factory.mktemp("grouped-run") / "p", per_job=3)
    check(run(prepared, root))
    return root


@pytest.fixture
def case(grouped, tmp_path):
    shutil.copytree(grouped, tmp_path / "case")  # copy2 keeps mtimes: as up to date as the original
    return tmp_path / "case"


def _evaluations(log: str) -> dict[str, str]:
    """drafter -> 'evaluated' | 'restored', from one job's log (the last word on each)."""
    done = {}
    for line in log.splitlines():
        for name in DRAFTERS:
            if f"{name} on {DATASET} (" in line and ("): evaluated in" in line or "): restored from" in line):
                done[name] = "evaluated" if "): evaluated in" in line else "restored"
    return done


def test_one_job_evaluates_the_group_in_one_process_with_one_output_per_checkpoint(prepared, grouped):
    calls = [c for c in (grouped / "calls.log").read_text().splitlines() if c.startswith("evaluate ")]
    assert len(calls) == 1 and calls[0].count("--member") == 1
    assert _evaluations(job_log(grouped)) == dict.fromkeys(DRAFTERS, "evaluated")
    assert all((grouped / name).is_file() for name in OUTPUTS)
    assert (grouped / f"results/benchmarks/evaluate/group-c0/{DATASET}.tsv").is_file()  # benchmark: per job
    claim = json.loads((grouped / f"results/benchmarks/evaluate/group-c0/{DATASET}.gpu.json").read_text())
    assert claim["device"] == "cpu" and "c0, c1, c2" in claim["job"]  # one claim for the process
    for name in DRAFTERS:  # each kept in the store under its own key
        assert (grouped / f"results/eval-store/{name}/{DATASET}/key.json").is_file()
    assert "Nothing to be done" in check(run(prepared, grouped, "-n"))


@pytest.mark.slow  # three processes of torch start-up for the ungrouped side (about 30 s on 2 loaded cores)
def test_a_grouped_run_equals_the_ungrouped_run_byte_for_byte(prepared, grouped, tmp_path):
    ungrouped = project(prepared, tmp_path / "ungrouped", per_job=1)
    check(run(prepared, ungrouped))
    assert not (ungrouped / "results/eval-store").exists(), "one checkpoint per job keeps no store"
    assert outputs(ungrouped) == outputs(grouped)


def test_a_changed_checkpoint_is_the_only_one_evaluated_again(prepared, case):
    before = outputs(case)
    other = prepared[2][3]  # a fourth checkpoint's files replace c1's
    shutil.rmtree(case / "ckpt/c1")
    shutil.copytree(other, case / "ckpt/c1")
    check(run(prepared, case))
    assert _evaluations(job_log(case)) == {"c0": "restored", "c1": "evaluated", "c2": "restored"}
    after = outputs(case)
    for name in OUTPUTS:
        assert (after[name] == before[name]) == ("/c1/" not in name), name


def test_a_targeted_rerun_of_one_checkpoint_restores_it_exactly(prepared, case):
    before = outputs(case)
    (case / f"results/eval/c2/{DATASET}/metrics.json").unlink()
    check(run(prepared, case, f"results/eval/c2/{DATASET}/metrics.json"))
    assert _evaluations(job_log(case)) == dict.fromkeys(DRAFTERS, "restored")
    assert outputs(case) == before


def test_a_failed_job_keeps_the_checkpoints_it_finished(prepared, tmp_path):
    root = project(prepared, tmp_path / "p", per_job=3)
    weights = root / "ckpt/c1/model.safetensors"
    good = weights.read_bytes()
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone().fill_(float("nan"))  # passes the load-time header checks, fails the load
    save_file(tensors, str(weights), metadata={"format": "pt"})
    failed = run(prepared, root)
    assert failed.returncode != 0
    assert _evaluations(job_log(root)) == {"c0": "evaluated"}
    assert not (root / f"results/eval/c0/{DATASET}/metrics.json").exists()  # Snakemake removed the job's outputs
    weights.write_bytes(good)
    check(run(prepared, root))
    assert _evaluations(job_log(root)) == {"c0": "restored", "c1": "evaluated", "c2": "evaluated"}
