"""Config and input faults found when the workflow loads, through the real snakemake on the tiny project.

Each test makes one fault in a project whose results all exist, runs snakemake, and checks the message
(file, line or key, and the fix), that no job ran and that every result is still there, byte for byte.
"""

from __future__ import annotations

import json
import shutil

import torch

from dflash_eval.testing.workflow import (
    fold_exports,
    job,
    load_config,
    plan,
    save_config,
    snakemake,
    write_bytes,
)
from tests.support.finished_project import refused, snapshot


def test_a_copied_drafter_block_is_refused_naming_the_file_and_both_lines(case):
    """YAML keeps the last of two equal keys: the copy would silently replace drafter a's result."""
    workflow, root = case
    text = (root / "config.yaml").read_text()
    lines = text.splitlines()
    start = lines.index("  a:")
    block = [lines[start]] + [line for line in lines[start + 1 : start + 8] if line.startswith("    ")]
    (root / "config.yaml").write_text(text + "\n".join(block).replace("  a:", "drafters:\n  a:", 1) + "\n")
    # a second top-level `drafters:` repeats that key too; the first repeat found is named
    out = refused(workflow, root)
    first = lines.index("drafters:") + 1
    second = len(lines) + 1
    assert f"config.yaml:{second}: key 'drafters' appears twice in one mapping (first at line {first})" in out
    assert "Rename one" in out


def test_a_repeated_key_inside_a_configfile_names_that_file(case):
    workflow, root = case
    (root / "extra.yaml").write_text("evaluation:\n  bootstrap: 20\n  seed: 1\n  bootstrap: 30\n")
    out = refused(workflow, root, "--configfile", str(root / "extra.yaml"))
    assert "extra.yaml:4: key 'bootstrap' appears twice in one mapping (first at line 2)" in out


def test_a_drafter_directory_given_as_the_target_is_refused_at_load(case):
    workflow, root = case
    target = root / "target" / "config.json"
    target.write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "num_hidden_layers": 4,
                "dflash_config": {"target_layer_ids": [1, 2]},
            }
        )
    )
    out = refused(workflow, root)
    assert "target.path: target holds a DFlash drafter (DFlashDraftModel), not a target model" in out


def test_a_prompt_id_that_is_a_turn_id_of_a_multi_turn_prompt_is_refused_at_load(case):
    workflow, root = case
    prompts = root / "prompts" / "d1.jsonl"
    prompts.write_text(
        prompts.read_text()
        + json.dumps({"id": "q", "turns": ["one", "two"]})
        + "\n"
        + json.dumps({"id": "q#2", "messages": [{"role": "user", "content": "x"}]})
        + "\n"
    )
    out = refused(workflow, root)
    assert (
        "datasets.d1.prompts: prompts/d1.jsonl:3: prompt 'q#2' has record id 'q#2', which the prompt at "
        "prompts/d1.jsonl:2 already has"
    ) in out


def test_block_sizes_beyond_a_drafters_own_and_max_tokens_past_the_positions_warn_at_load(finished, tmp_path):
    """Both ran silently before (a skipped chain named only in the evaluation job's log)."""
    workflow, project = finished
    root = tmp_path / "case"
    shutil.copytree(project, root)
    (root / "target" / "config.json").write_text('{"num_hidden_layers": 4, "max_position_embeddings": 8}')
    (root / "extra.yaml").write_text("evaluation:\n  block_sizes: [2, 6]\n")
    run = snakemake(workflow, root, "-n", "--configfile", str(root / "extra.yaml"))
    text = run.stdout + run.stderr
    assert "evaluation.block_sizes [6] exceed drafters.a's block size 4: its evaluation skips them" in text
    assert "fetch.max_tokens 8 reaches the target's max_position_embeddings 8 (target/config.json)" in text


def test_a_tab_in_config_yaml_names_the_file_line_and_column(case):
    """Snakemake's own message for a tab ("Config file is not valid JSON or YAML") names no file: the Snakefile reads
    config.yaml strictly before its `configfile:` directive. A plain `snakemake`, as a user runs it: the harness's
    --configfile would be read by Snakemake's command line first, before any workflow code (docs/running.md)."""
    import os
    import subprocess
    import sys

    workflow, root = case
    config = root / "config.yaml"
    lines = config.read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if line.startswith("  ") and ":" in line)
    lines[number] = "\t" + lines[number].lstrip()
    config.write_text("\n".join(lines) + "\n")
    before = snapshot(root)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(workflow / "Snakefile"),
            "--directory",
            str(root),
            "--workflow-profile",
            str(workflow / "profiles" / "default"),
            "--cores",
            "1",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": str(workflow / "src"),
            "PATH": f"{workflow / 'bin'}{os.pathsep}{os.environ['PATH']}",
        },
    )
    text = run.stdout + run.stderr
    assert run.returncode != 0, text
    assert (
        f"config.yaml:{number + 1}:1: not valid YAML: found character '\\t' that cannot start any token (YAML "
        "indents with spaces, never tabs: replace the tab there with spaces)" in text
    )
    assert snapshot(root) == before and not (root / "calls.log").exists(), "nothing ran, nothing was lost"


def test_the_rejection_scheme_for_a_dflash2_drafter_is_refused_at_load(case):
    """Refused before any job (it was refused only by the evaluation job, after extraction and its outage)."""
    workflow, root = case
    (root / "ckpt" / "a" / "config.json").write_text('{"block_size": 4, "architectures": ["DFlash2DraftModel"]}')
    (root / "extra.yaml").write_text("evaluation:\n  verify: [target_only, rejection]\n")
    out = refused(workflow, root, "--configfile", str(root / "extra.yaml"))
    assert (
        "drafters.a (in config.yaml): drafter a is a DFlash2DraftModel, but evaluation.verify asks for rejection" in out
    ), out
    assert "set evaluation.verify: target_only" in out and "drafters.b" not in out


def test_ddtree_under_the_rejection_scheme_alone_is_refused_at_load_naming_the_methods(case):
    workflow, root = case
    (root / "extra.yaml").write_text("evaluation:\n  verify: rejection\n  ddtree_budgets: [8, 32]\n")
    out = refused(workflow, root, "--configfile", str(root / "extra.yaml"))
    assert (
        "evaluation.verify (in extra.yaml): rejection alone, but evaluation.ddtree_budgets asks for ddtree-8, "
        "ddtree-32" in out
    ), out
    assert "Set evaluation.verify: [target_only, rejection]" in out and "evaluation.ddtree_budgets: []" in out


def test_the_rejection_scheme_on_greedy_datasets_warns_at_load_and_stores_no_log_probs(case):
    """At T 0 dflash_generate's scheme is target_only's: a warning, and the caches keep their params (no refetch or
    re-extraction: only the evaluations, whose settings name the scheme, would rerun)."""
    workflow, root = case
    (root / "extra.yaml").write_text("evaluation:\n  verify: [target_only, rejection]\n")
    run = snakemake(workflow, root, "-n", "--configfile", str(root / "extra.yaml"))
    text = run.stdout + run.stderr
    assert run.returncode == 0, text
    assert (
        "evaluation.verify asks for rejection, but datasets d1, d2 are greedy (temperature 0), where "
        "dflash_generate's scheme is target_only's greedy verification"
    ) in text
    assert "rule extract" not in text and "rule fetch" not in text, text


def test_a_training_run_of_bare_safetensors_steps_expands_to_one_drafter_per_step(case):
    """docs/reruns.md's bare `step_N.safetensors` steps beside one config.json (before: refused as an HF drafter
    directory without model.safetensors). The finished results stay; only the new steps' jobs are planned."""
    workflow, root = case
    run = root / "ckpt" / "run"
    for step in (100, 200):
        write_bytes(run / f"step_{step}.safetensors", 2048, seed=step)
    (run / "config.json").write_text('{"block_size": 4}')
    config = load_config(root)
    config["drafters"]["run"] = {"path": "ckpt/run", "layer_ids": [1, 2], "trained_with": "torch"}
    save_config(root, config)
    before = snapshot(root)
    assert fold_exports(plan(workflow, root)) == {
        job("evaluate", f"run-step{s}", d) for s in (100, 200) for d in ("d1", "d2")
    } | {job("report")}
    assert snapshot(root) == before
    write_bytes(run / "model.safetensors", 2048, seed=1)  # the variation: an HF directory with steps beside it
    out = refused(workflow, root)
    assert "drafters.run: ckpt/run: holds model.safetensors and also step_100.safetensors, step_200.safetensors" in out


def test_a_truncated_training_checkpoint_is_refused_at_load_with_its_reason_and_the_others_still_run(case):
    """A .pt whose copy stopped early: found at load from its zip directory (before: only at its evaluation, with
    the advice to set allow_pickle), named with the right reason, and the message says how to evaluate the other
    drafters meanwhile; that command runs them (a changed checkpoint's evaluations) and loses nothing."""
    workflow, root = case
    config = load_config(root)
    saved = root / "ckpt" / "t.pt"
    torch.save({"model_state_dict": {"fc.weight": torch.zeros(64, 64)}, "global_step": 5}, saved)
    whole = saved.stat().st_size
    saved.write_bytes(saved.read_bytes()[: whole // 2])
    config["drafters"]["t"] = {
        "path": "ckpt/t.pt",
        "config": "ckpt/a/config.json",
        "layer_ids": [1, 2],
        "trained_with": "torch",
    }
    save_config(root, config)
    out = refused(workflow, root)
    assert (
        f"drafters.t: ckpt/t.pt: {whole // 2} bytes, and its zip directory (the index torch.save writes at the "
        "end of the file) cannot be read (File is not a zip file): the file is truncated or damaged"
    ) in out
    assert "allow_pickle" not in out
    assert "To evaluate the other drafters meanwhile, leave t out: snakemake --config only=a,b" in out

    write_bytes(root / "ckpt" / "a" / "model.safetensors", 2048, seed=98)  # a's evaluations must rerun
    before = snapshot(root)
    run = snakemake(workflow, root, "--config", "only=a,b")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calls = (root / "calls.log").read_text().splitlines()
    assert sorted(calls) == ["evaluate results/eval/a/d1/metrics.json", "evaluate results/eval/a/d2/metrics.json"]
    after = snapshot(root)
    changed = sorted(k for k, v in before.items() if after.get(k) != v)
    assert changed and all("/a/" in k for k in changed), changed  # only drafter a's results and benchmarks
    assert saved.stat().st_size == whole // 2


def test_an_empty_training_checkpoint_is_refused_at_load(case):
    """The variation: a save that never wrote its file (0 bytes)."""
    workflow, root = case
    (root / "ckpt" / "t.pt").write_bytes(b"")
    config = load_config(root)
    config["drafters"]["t"] = {
        "path": "ckpt/t.pt",
        "config": "ckpt/a/config.json",
        "layer_ids": [1, 2],
        "trained_with": "torch",
    }
    save_config(root, config)
    out = refused(workflow, root)
    assert "drafters.t: ckpt/t.pt: 0 bytes: the file is empty (a save or copy that never wrote it)" in out
