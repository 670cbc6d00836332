"""Only what changed reruns: the real snakemake's plan after each kind of change, job by job.

Base project (src/dflash_eval/testing/workflow.py): datasets d1, d2; drafter a (HF dir) and b (50 MB .pt), both
on layers [1, 2]. Each test copies the finished base run, makes one change and compares the dry-run
plan with the exact set of jobs that the change must rerun.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_eval.testing import workflow as bench
from dflash_eval.testing.workflow import (
    add_hf_drafter,
    check,
    fold_exports,
    job,
    load_config,
    save_config,
    snakemake,
    tiny_project,
    write_bytes,
)
from tests.support.checkout import copy_workflow

ALL_EVALS = {job("evaluate", d, s) for d in "ab" for s in ("d1", "d2")}


def plan(workflow: Path, root: Path, *args: str) -> set[str]:
    """The dry-run plan, each evaluation's export folded into it (test_an_evaluations_export_follows_it unfolded)."""
    return fold_exports(bench.plan(workflow, root, *args))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("reruns")
    workflow = copy_workflow(root / "workflow")
    project = root / "base"
    tiny_project(project)
    check(snakemake(workflow, project))
    assert (project / "results" / "summary.csv").exists()
    return workflow, project


@pytest.fixture
def case(base, tmp_path):
    workflow, project = base
    copy = tmp_path / "case"
    shutil.copytree(project, copy)  # copy2 keeps mtimes, so the copy is as up to date as the original
    (copy / "calls.log").unlink()
    return workflow, copy


def test_finished_run_has_nothing_to_do(case):
    workflow, root = case
    assert plan(workflow, root) == set()


def test_outputs_an_interrupted_forcerun_removed_are_rebuilt_by_a_plain_rerun(case):
    """`--forcerun` removes a job's outputs before it runs; stopped there, the report is newer than what is now
    missing. A plain `snakemake` rebuilds exactly what is missing, then the report (before: "Nothing to be done",
    the report kept the old numbers)."""
    workflow, root = case
    (root / "results" / "eval" / "a" / "d1" / "metrics.json").unlink()
    assert plan(workflow, root) == {job("evaluate", "a", "d1"), job("report")}
    (root / "results" / "completions" / "d2.jsonl").unlink()
    shutil.rmtree(root / "results" / "hidden" / "d1" / "L1-2")
    assert plan(workflow, root) == {
        job("fetch", "d2"),
        job("extract", "d2", "L1-2"),
        job("extract", "d1", "L1-2"),
        job("evaluate", "a", "d2"),
        job("evaluate", "b", "d2"),
        job("evaluate", "a", "d1"),
        job("evaluate", "b", "d1"),
        job("report"),
    }


def test_checkpoint_content_change_reruns_its_evaluations_and_the_report(case):
    workflow, root = case
    write_bytes(root / "ckpt" / "a" / "model.safetensors", 2048, seed=99)
    assert plan(workflow, root) == {job("evaluate", "a", "d1"), job("evaluate", "a", "d2"), job("report")}


def test_touched_checkpoints_with_the_same_content_rerun_nothing(case):
    workflow, root = case
    later = Path(root / "results" / "summary.csv").stat().st_mtime + 3600
    for path in (
        root / "ckpt" / "a" / "model.safetensors",
        root / "ckpt" / "b.pt",
        root / "ckpt" / "b.json",
        root / "target" / "model.safetensors",
    ):
        os.utime(path, (later, later))
    write_bytes(root / "ckpt" / "b.pt", 50 * 2**20, seed=20)  # rewritten, same bytes
    assert (root / "ckpt" / "b.pt").stat().st_size == 50 * 2**20
    assert plan(workflow, root) == set()


def test_layer_list_change_extracts_the_new_set_and_keeps_the_old_cache(case):
    workflow, root = case
    config = load_config(root)
    config["drafters"]["b"]["layer_ids"] = [1, 3]
    save_config(root, config)
    expected = {
        job("extract", "d1", "L1-3"),
        job("extract", "d2", "L1-3"),
        job("evaluate", "b", "d1"),
        job("evaluate", "b", "d2"),
        job("report"),
    }
    assert plan(workflow, root) == expected
    check(snakemake(workflow, root))
    ran = fold_exports(set((root / "calls.log").read_text().splitlines()))
    assert ran == expected, "the real run ran exactly the planned jobs"
    assert (root / "results" / "hidden" / "d1" / "L1-2" / "manifest.json").exists(), "old layer set's cache kept"
    assert (root / "results" / "hidden" / "d1" / "L1-3" / "manifest.json").exists()


def test_fetch_parameter_change_reruns_everything_downstream_of_that_dataset(case):
    workflow, root = case
    config = load_config(root)
    config["datasets"]["d1"]["max_samples"] = 1
    save_config(root, config)
    assert plan(workflow, root) == {
        job("fetch", "d1"),
        job("extract", "d1", "L1-2"),
        job("evaluate", "a", "d1"),
        job("evaluate", "b", "d1"),
        job("report"),
    }


def test_a_prompt_files_order_reruns_nothing_and_an_edited_prompt_reruns_its_dataset(case):
    """Issue 32: the prompt file was an input by mtime, so a reordered (or touched) file reran every evaluation.
    It is tracked by its prompts as a set (params.prompts)."""
    workflow, root = case
    prompts = root / "prompts" / "d1.jsonl"
    first = prompts.read_text()
    prompts.write_text(first + json.dumps({"id": "p1", "messages": [{"role": "user", "content": "q9"}]}) + "\n")
    d1 = {
        job("fetch", "d1"),
        job("extract", "d1", "L1-2"),
        job("evaluate", "a", "d1"),
        job("evaluate", "b", "d1"),
        job("report"),
    }
    assert plan(workflow, root) == d1
    check(snakemake(workflow, root))
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n".join(reversed(lines)) + "\n\n")  # reordered, and a blank line more
    assert plan(workflow, root) == set()
    os.utime(prompts)
    assert plan(workflow, root) == set()
    prompts.write_text(prompts.read_text().replace("q9", "q10"))
    assert plan(workflow, root) == d1


def test_server_and_fetch_runtime_changes_rerun_nothing(case):
    """How fetch and extract run (server, concurrency, timeouts, retries) does not change what they produce:
    rerunning them would discard hours of completions and of GPU time. The new values still reach the stages."""
    workflow, root = case
    config = load_config(root)
    config["server"].update(health_timeout_s=1234, stop_grace_s=7, base_url="http://127.0.0.1:10")
    config["fetch"].update(concurrency=3, timeout_s=99, retries=9)
    save_config(root, config)
    assert plan(workflow, root) == set()
    (root / "runtime.log").unlink()
    check(snakemake(workflow, root, "--forcerun", "fetch"))
    calls = [json.loads(line) for line in (root / "runtime.log").read_text().splitlines()]
    fetches, extracts = [c for c in calls if "concurrency" in c], [c for c in calls if "concurrency" not in c]
    assert len(fetches) == len(extracts) == 2
    assert all(c["concurrency"] == 3 and c["timeout_s"] == 99 and c["retries"] == 9 for c in fetches)
    assert all(c["server"]["health_timeout_s"] == 1234 and c["server"]["base_url"].endswith(":10") for c in calls)


def test_added_drafter_runs_only_its_evaluations_and_the_report(case):
    workflow, root = case
    config = load_config(root)
    add_hf_drafter(root, config, "c", seed=30)
    save_config(root, config)
    assert plan(workflow, root) == {job("evaluate", "c", "d1"), job("evaluate", "c", "d2"), job("report")}


def test_editing_the_user_serving_profile_reruns_the_report_only(case):
    """speedup.profile is an input of the report alone (it makes the expected speedup from each metrics.json and
    the profile, report/speedup.py): naming or editing it reruns the report, never an evaluation, fetch or
    extraction; a touch with the same bytes reruns nothing; a bad field stops the run at load."""
    workflow, root = case
    profile = root / "profile.json"
    profile.write_text(json.dumps({"t_ar_ms": 20, "t_verify_ms": {"1": 20, "16": 24}}))
    config = load_config(root)
    config["speedup"] = {"profile": "profile.json"}
    save_config(root, config)
    assert plan(workflow, root) == {job("report")}
    check(snakemake(workflow, root))
    assert plan(workflow, root) == set()
    later = (root / "results" / "summary.csv").stat().st_mtime + 3600
    os.utime(profile, (later, later))
    assert plan(workflow, root) == set()
    profile.write_text(json.dumps({"t_ar_ms": 25, "t_verify_ms": {"1": 25, "16": 30}}))
    os.utime(profile, (later, later))
    assert plan(workflow, root) == {job("report")}
    profile.write_text(json.dumps({"t_ar_ms": 0, "t_verify_ms": {"1": 25}}))
    run = snakemake(workflow, root, "--dry-run")
    assert run.returncode != 0
    assert "profile.json: field 't_ar_ms' must be a positive number" in run.stdout + run.stderr


def _edit(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _private_copies(base, tmp_path: Path) -> tuple[Path, Path]:
    """A workflow copy whose code a test may edit, and a copy of the finished project."""
    workflow, project = base
    shutil.copytree(workflow, tmp_path / "workflow")
    shutil.copytree(project, tmp_path / "case")
    return tmp_path / "workflow", tmp_path / "case"


def test_stage_code_change_reruns_that_stage_and_what_follows(base, tmp_path):
    code, root = _private_copies(base, tmp_path)
    evaluator = code / "src" / "dflash_eval" / "evaluate" / "trajectory.py"  # imported by the evaluate stage
    original = evaluator.read_text()
    _edit(evaluator, "\n# a comment and blank lines do not count\n\n")
    assert plan(code, root) == set()
    _edit(evaluator, "_CHANGED = True\n")
    assert plan(code, root) == ALL_EVALS | {job("report")}
    evaluator.write_text(original)  # back to the recorded code: the report's own code alone
    _edit(code / "src" / "dflash_eval" / "report" / "stage.py", "_CHANGED = True\n")
    assert plan(code, root) == {job("report")}


def test_only_evaluates_the_named_drafters_without_the_report(case):
    workflow, root = case
    write_bytes(root / "ckpt" / "a" / "model.safetensors", 2048, seed=98)
    write_bytes(root / "ckpt" / "b.pt", 1024, seed=97)
    assert plan(workflow, root, "--config", "only=a") == {job("evaluate", "a", "d1"), job("evaluate", "a", "d2")}
    assert plan(workflow, root, "--config", "only=b", "only_datasets=d2") == {job("evaluate", "b", "d2")}
    # a per-file target does the same for one evaluation
    assert plan(workflow, root, "results/eval/a/d1/metrics.json") == {job("evaluate", "a", "d1")}


def test_missing_checkpoint_is_a_clear_error(case):
    workflow, root = case
    (root / "ckpt" / "b.pt").unlink()
    run = snakemake(workflow, root, "--dry-run")
    assert run.returncode != 0
    assert "drafters.b.path: ckpt/b.pt does not exist" in run.stdout + run.stderr


def test_step_directory_expands_to_one_evaluation_per_step_and_new_steps_add_only_their_jobs(case):
    workflow, root = case
    run_dir = root / "ckpt" / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"block_size": 4}')
    for step in (100, 200):
        write_bytes(run_dir / f"step_{step}.pt", 1024, seed=step)
    config = load_config(root)
    config["drafters"]["run"] = {"path": "ckpt/run", "layer_ids": [1, 2], "trained_with": "torch"}
    save_config(root, config)
    check(snakemake(workflow, root))
    ran = fold_exports(set((root / "calls.log").read_text().splitlines()))
    assert ran == {job("evaluate", f"run-step{s}", d) for s in (100, 200) for d in ("d1", "d2")} | {job("report")}
    stamp = json.loads((root / "results" / "eval" / "run-step200" / "d1" / "metrics.json").read_text())
    settings = json.loads(stamp["settings"])  # what the evaluate stage received
    assert settings["checkpoint"]["step"] == 200 and settings["checkpoint"]["path"] == "ckpt/run/step_200.pt"
    assert settings["checkpoint"]["config"] == "ckpt/run/config.json"
    report = json.loads(json.loads((root / "results" / "summary.csv").read_text())["settings"])
    assert report["drafters"]["run-step200"] == {"step": 200, "run": "run", "layer_ids": [1, 2]}

    write_bytes(run_dir / "step_300.pt", 1024, seed=300)
    new_step = {job("evaluate", "run-step300", "d1"), job("evaluate", "run-step300", "d2")}
    assert plan(workflow, root) == new_step | {job("report")}
    assert plan(workflow, root, "--config", "only=run") == new_step  # the directory's name selects its steps


def test_an_evaluations_export_follows_it_and_the_profiles_buckets_rerun_only_the_exports(case):
    workflow, root = case
    write_bytes(root / "ckpt" / "a" / "model.safetensors", 2048, seed=96)
    a = {job(rule, "a", s) for rule in ("evaluate", "export") for s in ("d1", "d2")}
    assert bench.plan(workflow, root) == a | {job("report")}
    write_bytes(root / "ckpt" / "a" / "model.safetensors", 2048, seed=10)  # back to the base run's bytes
    config = load_config(root)
    config["report"] = {**config.get("report", {}), "context_buckets": [64, 4096]}
    save_config(root, config)
    assert bench.plan(workflow, root) == {job("export", d, s) for d in "ab" for s in ("d1", "d2")} | {job("report")}


# ----- code identities: each stage reruns on the code declared as deciding its outputs (provenance/identity.py) ---

PIN = ("--rerun-triggers", "mtime", "params", "input", "software-env")  # code out of the decision (docs/reruns.md)
EXTRACTS = {job("extract", d, "L1-2") for d in ("d1", "d2")}


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


def _code_case(base, tmp_path: Path) -> tuple[Path, Path, Path]:
    code, root = _private_copies(base, tmp_path)
    (root / "calls.log").unlink()
    return code, root, code / "src" / "dflash_eval"


def _planned_then_ran(code: Path, root: Path, expected: set[str], *args: str) -> None:
    """`snakemake -n` plans exactly `expected`, and the run then runs exactly that."""
    assert plan(code, root, *args) == expected
    check(snakemake(code, root, *args))
    log = root / "calls.log"
    assert (fold_exports(set(log.read_text().splitlines())) if log.exists() else set()) == expected
    if log.exists():
        log.unlink()
    assert plan(code, root, *args) == set()


def test_docstrings_comments_and_the_settings_modules_code_rerun_nothing(base, tmp_path):
    code, root, src = _code_case(base, tmp_path)
    for module in (
        "evaluate/acceptance.py",
        "extract/capture.py",
        "fetch/sglang.py",
        "report/summary.py",
        "speedup/model.py",
    ):
        _replace(src / module, '"""', '"""Reworded, with a new first sentence. ')
        _edit(src / module, "\n\n# a comment, and blank lines\n\n")
    _edit(src / "config.py", "\n_A_REFACTOR_OF_THE_SETTINGS_MODULE = True\n")  # settings decide, not config.py
    for builders in ("drafters.py", "fetch/settings.py", "extract/settings.py", "evaluate/settings.py"):
        _edit(src / builders, "\n_A_REFACTOR_OF_THE_SETTINGS_BUILDER = True\n")  # nor the builders beside stages
    _planned_then_ran(code, root, set())


def test_a_report_only_table_and_its_option_rerun_the_report_only(base, tmp_path):
    code, root, src = _code_case(base, tmp_path)
    (src / "report" / "new_table.py").write_text('"""A new table."""\n\n\ndef rows():\n    return []\n')
    _edit(src / "report" / "stage.py", "\nfrom dflash_eval.report import new_table  # noqa: E402,F401\n")
    _replace(
        src / "report" / "settings.py",
        '        "bootstrap": config["evaluation"]["bootstrap"],\n',
        '        "bootstrap": config["evaluation"]["bootstrap"],\n        "new_table": True,\n',
    )
    _planned_then_ran(code, root, {job("report")})


def test_a_change_to_the_chains_accepted_length_reruns_the_evaluations_and_the_report(base, tmp_path):
    code, root, src = _code_case(base, tmp_path)
    _edit(src / "evaluate" / "acceptance.py", "\n_ACCEPTED_LENGTH_CHANGED = True\n")
    _planned_then_ran(code, root, ALL_EVALS | {job("report")})


def test_a_change_to_the_hidden_state_capture_reruns_extraction_and_what_follows(base, tmp_path):
    """No fetch. That the rerun computes the states instead of copying the kept ones:
    tests/extract/test_state_code.py."""
    code, root, src = _code_case(base, tmp_path)
    _edit(src / "extract" / "capture.py", "\n_CAPTURE_CHANGED = True\n")
    _planned_then_ran(code, root, EXTRACTS | ALL_EVALS | {job("report")})


def test_a_change_to_the_speedup_validation_loops_reruns_nothing(base, tmp_path):
    """speedup/live_loops/ runs only in benchmarks/speedup_validation.py's live loops."""
    code, root, src = _code_case(base, tmp_path)
    _edit(src / "speedup" / "live_loops" / "chain.py", "\n_LOOP_CHANGED = True\n")
    _edit(src / "speedup" / "live_loops" / "run.py", "\n_LOOP_CHANGED = True\n")
    _planned_then_ran(code, root, set())


def test_the_pin_keeps_any_code_edit_out_of_the_rerun_and_status_names_what_older_code_made(base, tmp_path):
    code, root, src = _code_case(base, tmp_path)
    before = _status(code, root)
    assert "were made by this code" in before, before
    for module in ("evaluate/acceptance.py", "extract/capture.py", "fetch/sglang.py", "report/summary.py"):
        _edit(src / module, "\n_CHANGED = True\n")
    assert plan(code, root) == {job("fetch", d) for d in ("d1", "d2")} | EXTRACTS | ALL_EVALS | {job("report")}
    _planned_then_ran(code, root, set(), *PIN)
    line = _status(code, root)
    assert line.startswith("dflash-eval status: 9 of 9 stamped outputs were made by older code (")
    for output in (
        "results/completions/d1.jsonl",
        "results/hidden/d1/L1-2",
        "results/eval/a/d1/metrics.json",
        "results/eval/b/d2/metrics.json",
        "results/trust.json",
    ):
        assert output in line
    config = load_config(root)  # settings still count under the pin
    config["datasets"]["d1"]["max_samples"] = 1
    save_config(root, config)
    d1 = {
        job("fetch", "d1"),
        job("extract", "d1", "L1-2"),
        job("evaluate", "a", "d1"),
        job("evaluate", "b", "d1"),
        job("report"),
    }
    _planned_then_ran(code, root, d1, *PIN)
    assert "results/eval/a/d1/metrics.json" not in _status(code, root), "rerun by the new code: its stamp"


def _status(code: Path, root: Path) -> str:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "from dflash_eval.cli import entry; entry()", "status"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(code / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


PROFILE_TARGET = "profile_target results/profile/target/cpu-float32-torch.json"


def test_a_change_to_the_target_timing_code_reruns_the_profile_rule_and_the_report_only(base, tmp_path):
    """The target is timed once, in its own rule (one profile per target, device, dtype and backend), and the report
    makes the expected speedup from it: a change to the target-timing code reruns that rule and the report, no
    extraction and no evaluation (no fetch)."""
    code, root, src = _code_case(base, tmp_path)
    # the stand-in dflash-eval (bench.RECORDER) writes the profile rule's --out as it writes the other outputs
    _replace(code / "bin" / "dflash-eval", '"report": ["--csv"', '"profile-target": ["--out"], "report": ["--csv"')
    config = load_config(root)
    config["speedup"] = {"measure": True}  # times the target on this CPU (auto: CUDA only), and the drafter step
    save_config(root, config)

    def ran(expected: set[str]) -> None:
        assert plan(code, root) == expected
        check(snakemake(code, root))
        log = root / "calls.log"
        calls = {line.replace("profile-target ", "profile_target ", 1) for line in log.read_text().splitlines()}
        assert fold_exports(calls) == expected
        log.unlink()
        assert plan(code, root) == set()

    # the evaluations' drafter timing is a setting of theirs (speedup.measure), the profile rule a new job
    ran({PROFILE_TARGET} | ALL_EVALS | {job("report")})
    stamp = json.loads((root / "results" / "profile" / "target" / "cpu-float32-torch.json").read_text())
    assert stamp["code_identity"].startswith("profile-target.v1.sha256:")
    _edit(src / "tools" / "target_timing.py", "\n_TIMING_CHANGED = True\n")
    ran({PROFILE_TARGET, job("report")})
    _edit(src / "tools" / "target_timing.py", "\n# a comment\n")
    assert plan(code, root) == set()


def _top_level(path: Path, name: str) -> str:
    """The source of the top-level function `name` in `path`."""
    import ast

    text = path.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node)


def test_moving_a_function_or_renaming_a_module_reruns_nothing_and_editing_the_moved_code_does(base, tmp_path):
    """The identity is over the stage's code, not its file layout (provenance/identity.py's hash rule)."""
    code, root, src = _code_case(base, tmp_path)
    acceptance, blocks = src / "evaluate" / "acceptance.py", src / "evaluate" / "blocks.py"
    moved = _top_level(acceptance, "matched_prefix")
    _replace(acceptance, moved, "")  # moved to blocks.py, imported back where it was
    _edit(acceptance, "\nfrom dflash_eval.evaluate.blocks import matched_prefix  # noqa: E402,F401\n")
    _edit(blocks, "\n\n" + moved + "\n")
    packed = src / "evaluate" / "packed.py"  # renamed: its importers and its declaration follow
    packed.rename(src / "evaluate" / "packed_rows.py")
    for caller in src.rglob("*.py"):
        if "evaluate.packed import" in caller.read_text():
            _replace(caller, "evaluate.packed import", "evaluate.packed_rows import")
        if "evaluate import packed\n" in caller.read_text():  # a module import keeps its name in the code
            _replace(caller, "evaluate import packed\n", "evaluate import packed_rows as packed\n")
    _replace(src / "provenance" / "identity.py", '"evaluate.packed",', '"evaluate.packed_rows",')
    _planned_then_ran(code, root, set())
    _replace(blocks, moved, moved.replace("-> torch.Tensor:\n", "-> torch.Tensor:\n    tokens = tokens.clone()\n", 1))
    assert plan(code, root) == ALL_EVALS | {job("report")}


def test_a_vllm_code_change_reruns_nothing_for_an_sglang_server_and_an_sglang_one_reruns_fetch(base, tmp_path):
    """fetch's identity covers the engine server.engine names (auto: every engine, detected only when fetch runs)."""
    code, root, src = _code_case(base, tmp_path)
    config = load_config(root)
    config["server"]["engine"] = "sglang"  # from auto's identity (every engine's code) to SGLang's: fetch once
    save_config(root, config)
    everything = {job("fetch", d) for d in ("d1", "d2")} | EXTRACTS | ALL_EVALS | {job("report")}
    _planned_then_ran(code, root, everything)
    _edit(src / "fetch" / "vllm.py", "\n_VLLM_CHANGED = True\n")
    _edit(src / "vllm_protocol.py", "\n_VLLM_CHANGED = True\n")
    _planned_then_ran(code, root, set())
    _edit(src / "fetch" / "sglang.py", "\n_SGLANG_CHANGED = True\n")
    assert plan(code, root) == everything
    config["server"]["engine"] = "auto"  # auto covers vLLM's code too: the edit above counts
    save_config(root, config)
    assert plan(code, root) == everything
