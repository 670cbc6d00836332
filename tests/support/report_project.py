"""A project of the report rule alone: the upstream stages' outputs as they write them, a Snakefile that
includes the repository's report rule, and a Snakemake run of it (the report HTML and failure tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.checkout import REPO
from tests.support.report_inputs import SETTINGS, write_metrics, write_trust_inputs

SNAKEFILE = """
from dflash_eval.config import validate_config

configfile: "config.yaml"
config = validate_config(config, "config.yaml")

include: "{repo}/workflow/rules/common.smk"
include: "{repo}/workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
"""


def report_config() -> dict:
    return {
        "target": {"path": "/models/target"},
        "server": {"kind": "managed", "base_url": "http://127.0.0.1:1", "command": "true"},
        "fetch": {},
        "extraction": {},
        "evaluation": {"bootstrap": 200},
        "speedup": {"measure": False},  # the target is not timed here: no profile_target rule is included
        "datasets": {name: {"prompts": f"{name}.jsonl"} for name in SETTINGS["datasets"]},
        "drafters": {
            name: {"path": f"/ckpt/{name}", "layer_ids": spec["layer_ids"], "step": spec["step"]}
            for name, spec in SETTINGS["drafters"].items()
        },
        "report": {key: SETTINGS[key] for key in ("reference", "served_drafter", "online_tolerance")},
    }


def report_snakemake(root: Path, *args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{repo / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    command = [sys.executable, "-m", "snakemake", "--snakefile", "Snakefile", "--cores", "1", *args]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def report_project(root: Path, repo: Path = REPO) -> Path:
    """Metrics, caches, completions and transitions as the upstream stages write them, and `repo`'s report rule."""
    results = root / "results"
    write_metrics(results)
    for path in (results / "eval").rglob("metrics.json"):  # the rule names caches relative to the workdir
        text = path.read_text().replace(str(results / "hidden"), "results/hidden")
        path.write_text(text)
    write_trust_inputs(results)
    (root / "Snakefile").write_text(SNAKEFILE.format(repo=repo))
    (root / "config.yaml").write_text(yaml.safe_dump(report_config()))
    return results
