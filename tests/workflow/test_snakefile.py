"""The Snakefile on the repository's own config.yaml (dry runs): the demo's settings reach its rules, demo.enabled
decides whether the demo's rules exist, and the wildcards match only the names config.yaml gives."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from dflash_eval.testing.workflow import check, snakemake
from tests.support.checkout import REPO


@pytest.fixture
def project(tmp_path):
    shutil.copy(REPO / "config.yaml", tmp_path / "config.yaml")
    shutil.copytree(REPO / "resources" / "prompts", tmp_path / "resources" / "prompts")
    return tmp_path


def _set_demo(root, **values) -> None:
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["demo"].update(values)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def test_the_demo_target_trains_the_steps_of_config_yaml(project):
    text = check(snakemake(REPO, project, "-n", "-p", "resources/demo/target/config.json"))
    assert "demo-target --tokenizer resources/demo/tokenizer --out resources/demo/target --seed 0 --steps 300 " in text
    _set_demo(project, target_steps=7)
    assert "--seed 0 --steps 7 " in check(snakemake(REPO, project, "-n", "-p", "resources/demo/target/config.json"))


def test_the_build_device_reaches_the_demo_commands_only_off_the_cpu(project):
    """On the CPU (the default) the demo's build commands are the ones from before demo.build_device existed, so a
    CPU demo rebuilds nothing for the setting; another device is in the command, which the code trigger compares."""
    target, drafters = "resources/demo/target/config.json", "resources/demo/drafters/step900/config.json"
    text = check(snakemake(REPO, project, "-n", "-p", "--forceall", drafters))
    assert "--steps 300 > /dev/null" in text and "--workers" in text and "--device" not in text
    _set_demo(project, build_device="cuda:0")
    text = check(snakemake(REPO, project, "-n", "-p", "--forceall", target, drafters))
    assert "--steps 300 --device cuda:0 > /dev/null" in text
    assert re.search(r"demo-drafters .* --device cuda:0 > /dev/null", text)


def test_without_demo_enabled_the_demo_is_not_built_and_its_paths_say_so(project):
    _set_demo(project, enabled=False)
    run = snakemake(REPO, project, "-n")
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert re.search(
        r"resources/demo/\S+ does not exist \(the workflow builds the demo's models only with "
        r"demo\.enabled: true\)",
        text,
    )  # named when the workflow loads (workflow.preflight.check_inputs)


def test_wildcards_match_only_configured_names(project):
    run = snakemake(REPO, project, "-n", "results/eval/demo-step60/other/metrics.json")
    assert run.returncode != 0 and "MissingRuleException" in run.stdout + run.stderr
    check(snakemake(REPO, project, "-n", "results/eval/demo-step60/demo-code/metrics.json"))
