"""Faults a new user hit, through the real snakemake on the tiny project: nothing lost, nothing silent.

Each test makes the faults, runs snakemake, and checks the message and that every result that existed
before still exists, byte for byte. The load-time battery runs with the recording dflash-eval
(src/dflash_eval/testing/workflow.py); the fetch test runs the real `dflash-eval fetch` against a real HTTP
server process (dflash_eval/testing/fake_openai_server.py), as Snakemake calls it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from dflash_eval.target_identity import torch_cuda_version
from dflash_eval.testing import fixtures
from dflash_eval.testing.workflow import (
    add_hf_drafter,
    check,
    load_config,
    save_config,
    snakemake,
    tiny_project,
    write_bytes,
)
from tests.support.checkout import copy_workflow
from tests.support.fake_fetch import fake_process
from tests.support.finished_project import snapshot

REAL_CLI = "#!{python}\nimport sys\nfrom dflash_eval.cli import main\nsys.exit(main())\n"


def test_missing_paths_and_contradictions_stop_the_run_at_load_with_results_intact(case):
    """A battery of faults in one config: every one is named with its key, before any job runs, although
    every result exists (before, `snakemake` said "Nothing to be done" over the stale numbers)."""
    workflow, root = case
    before = snapshot(root)
    config = load_config(root)
    config["drafters"]["a"]["path"] = "ckpt/moved"  # a directory that is not there
    (root / "prompts" / "d2.jsonl").write_text(
        '{"id": "p0", "messages": [{"role": "user", "content": "q"}]}\n'
        '{"id": "p1", "messages": [{"role": "user", "content": "   "}]}\n'
    )
    config["datasets"]["d3"] = {"prompts": "prompts/d3.jsonl"}  # a new dataset whose file is missing
    (root / "prompts" / "d4.jsonl").write_bytes(b'{"id": "p0", "messages": [{"role": "user", "content": "\xff"}]}\n')
    config["datasets"]["d4"] = {"prompts": "prompts/d4.jsonl"}
    (root / "ckpt" / "b" / "config.json").write_text('{"dflash_config": {"target_layer_ids": [1, 3]}}')
    add_hf_drafter(root, config, "wide", seed=3)  # fc.weight takes 3 layers, the list has 2
    (root / "ckpt" / "wide" / "config.json").write_text('{"hidden_size": 8}')
    import torch

    save_file({"fc.weight": torch.zeros(8, 24)}, root / "ckpt" / "wide" / "model.safetensors")
    add_hf_drafter(root, config, "fla", seed=4)
    config["drafters"]["fla"]["trained_with"] = "fla"
    add_hf_drafter(root, config, "cut", seed=5)
    weights = root / "ckpt" / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    cpu_torch = torch_cuda_version() is None
    if cpu_torch:
        config["evaluation"]["device"] = "cuda:0"
    save_config(root, config)

    run = snakemake(workflow, root)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "Nothing to be done" not in text
    expected = [
        "drafters.a.path: ckpt/moved does not exist",
        "datasets.d2.prompts: prompts/d2.jsonl:2: messages[0] (user): content is empty or whitespace only",
        "datasets.d3.prompts: prompts/d3.jsonl does not exist",
        "datasets.d4.prompts: prompts/d4.jsonl:1: byte 0xff at column 56 is not UTF-8",
        (
            "drafters.b: ckpt/b: config.yaml says layer_ids [1, 2] but the drafter config (ckpt/b/config.json) says "
            "target_layer_ids [1, 3]"
        ),
        "drafters.wide: ckpt/wide: fc.weight (8, 24) takes 3 target layers but target_layer_ids [1, 2] has 2",
        "drafters.fla.trained_with: fla, but target.backend is torch",
        (
            f"drafters.cut: ckpt/cut/model.safetensors: {weights.stat().st_size} bytes, but its header says "
            f"{weights.stat().st_size + 10}: the file is truncated"
        ),
    ] + (["evaluation.device is cuda:0, but the installed torch"] if cpu_torch else [])
    for line in expected:
        assert line in text, line
    assert f"{len(expected)} problem(s), found before any job ran" in text
    assert snapshot(root) == before, "nothing was removed or rewritten"
    assert not (root / "calls.log").exists(), "no job ran"


def test_config_errors_name_the_configfile_that_set_the_key_and_the_minimum(case):
    workflow, root = case
    before = snapshot(root)
    (root / "extra.yaml").write_text("evaluation:\n  block_sizes: [1]\n  bogus: 2\n")
    run = snakemake(workflow, root, "--configfile", str(root / "extra.yaml"))
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert "config.yaml + extra.yaml is not valid" in text
    assert (
        "evaluation.block_sizes (in extra.yaml): [1] is none of the allowed forms: 1 is less than the minimum "
        "of 2 (at evaluation.block_sizes.0); or 'all' was expected" in text
    )
    assert "evaluation (in extra.yaml): Additional properties are not allowed ('bogus' was unexpected)" in text
    assert snapshot(root) == before


def test_a_cache_shard_modified_after_extraction_is_reported_by_the_dry_run(case):
    """The dry run cannot hash the caches, but one stat a shard shows what changed after extraction."""
    import torch

    from dflash_eval.cache.writer import CacheWriter

    workflow, root = case
    cache = root / "results" / "hidden" / "d1" / "L1-2"
    shutil.rmtree(cache)
    header = {
        "dataset": "d1",
        "target": {},
        "backend": {"name": "torch"},
        "device": "cpu",
        "completions": {"path": "results/completions/d1.jsonl"},
    }
    with CacheWriter(cache, layer_ids=[1, 2], shard_tokens=8, store_argmax=False, header=header) as writer:
        for i in range(3):
            writer.add(f"p{i}", torch.arange(5), {1: torch.ones(5, 4), 2: torch.ones(5, 4)}, None, 2)
        writer.finish()
    quiet = snakemake(workflow, root, "--dry-run")
    assert quiet.returncode == 0 and "changed after its extraction" not in quiet.stdout + quiet.stderr
    shard = cache / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    run = snakemake(workflow, root, "--dry-run")
    text = run.stdout + run.stderr
    assert run.returncode == 0
    assert (
        "WARNING: 1 shard(s) of the hidden cache results/hidden/d1/L1-2 changed after its extraction: "
        "results/hidden/d1/L1-2/shard_00001.safetensors (size or modification time differs"
    ) in text
    assert "snakemake --forcerun results/hidden/d1/L1-2" in text and "--layers 1,2" in text


def _requests(log: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in log.read_text().splitlines()] if log.exists() else []


def test_a_prompt_file_edit_loses_no_completions_and_sends_only_the_new_prompt(tmp_path):
    """The real fetch stage under Snakemake: an appended prompt reruns fetch (Snakemake removes the completions
    first), which sends that prompt alone; a malformed line is refused at load, the completions untouched.
    The first fetch runs under Snakemake too: a prompt file is tracked by its prompts (params.prompts, issue 32),
    compared with what Snakemake recorded of the run that wrote the completions."""

    workflow = copy_workflow(tmp_path / "workflow")
    (workflow / "bin" / "dflash-eval").write_text(REAL_CLI.format(python=sys.executable))
    root = tmp_path / "project"
    config = tiny_project(root, drafters=1, datasets=1)
    fixtures.build_tokenizer(root / "target")  # the target directory is also the tokenizer fetch renders with
    write_bytes(root / "target" / "model.safetensors", 64, seed=1)
    prompts = fixtures.write_prompts(root / "prompts" / "d1.jsonl", 3)
    log = tmp_path / "requests.jsonl"
    completions = root / "results" / "completions" / "d1.jsonl"
    with fake_process(root / "target", log) as (_, url):
        config["server"] = {"kind": "external", "base_url": url, "start_command": "false", "stop_command": "true"}
        save_config(root, config)
        check(snakemake(workflow, root, str(completions.relative_to(root))))
        first = completions.read_text().splitlines()
        assert len(first) == 3 and len(_requests(log)) == 3

        with open(prompts, "a") as handle:
            handle.write(
                json.dumps({"id": "p3", "messages": [{"role": "user", "content": "Question 3: and 3 + 3?"}]}) + "\n"
            )
        check(snakemake(workflow, root, str(completions.relative_to(root))))
        again = completions.read_text().splitlines()
        assert again[:3] == first and len(again) == 4, "the 3 earlier records reused as they were"
        assert len(_requests(log)) == 4 and "Question 3: and 3 + 3?" in _requests(log)[-1], "only the new one sent"
        fetch_log = (root / "results" / "logs" / "fetch" / "d1.log").read_text()
        assert '"fetched": 1, "reused": 3' in fetch_log

        kept = completions.read_bytes()
        with open(prompts, "a") as handle:
            handle.write('{"id": "p4", "messages": [}\n')
        run = snakemake(workflow, root, str(completions.relative_to(root)))
        assert run.returncode != 0
        assert "datasets.d1.prompts: prompts/d1.jsonl:5: invalid JSON" in run.stdout + run.stderr
        assert completions.read_bytes() == kept and len(_requests(log)) == 4
