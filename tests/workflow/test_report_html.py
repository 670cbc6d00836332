"""`snakemake --report` builds the HTML report from the real report rule, on a finished tiny run.

The run includes only workflow/rules/report.smk (with common.smk) so that the metrics, caches and
completions written here are plain inputs: it takes two snakemake invocations, not the demo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from dflash_eval.report import plots
from tests.report.test_stage import SETTINGS, metrics_dict, write_metrics, write_trust_inputs

REPO = Path(__file__).resolve().parents[2]
SNAKEFILE = f"""
from dflash_eval.config import validate_config

configfile: "config.yaml"
config = validate_config(config, "config.yaml")

include: "{REPO}/workflow/rules/common.smk"
include: "{REPO}/workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
"""


def _config() -> dict:
    return {
        "target": {"path": "/models/target"},
        "server": {"kind": "managed", "base_url": "http://127.0.0.1:1", "command": "true"},
        "fetch": {}, "extraction": {}, "evaluation": {"bootstrap": 200},
        "datasets": {name: {"prompts": f"{name}.jsonl"} for name in SETTINGS["datasets"]},
        "drafters": {name: {"path": f"/ckpt/{name}", "layer_ids": spec["layer_ids"], "step": spec["step"]}
                     for name, spec in SETTINGS["drafters"].items()},
        "report": {key: SETTINGS[key] for key in ("reference", "served_drafter", "online_tolerance")},
    }


def _snakemake(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "snakemake", "--snakefile", "Snakefile", "--cores", "1", *args]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_report_rule_runs_and_snakemake_report_builds_the_html(tmp_path):
    results = tmp_path / "results"
    write_metrics(results)
    for path in (results / "eval").rglob("metrics.json"):  # the rule names caches relative to the workdir
        text = path.read_text().replace(str(results / "hidden"), "results/hidden")
        path.write_text(text)
    write_trust_inputs(results)
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(_config()))

    run = _snakemake(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    table = pd.read_csv(results / "summary.csv")
    row = table[(table.drafter == "step-2000") & (table.dataset == "gsm8k") & (table.method == "chain-B4")].iloc[0]
    assert row.tau_mean_of_samples == metrics_dict("step-2000", "gsm8k")["chain"]["tau_mean_of_samples"]
    for name in plots.NAMES.values():
        assert (results / "plots" / name).stat().st_size > 10_000
    markdown = (results / "summary.md").read_text()
    assert "| `results/hidden/gsm8k/L1-3` |" in markdown and "60.5 s in all" in markdown   # caches, outages found

    html = _snakemake(tmp_path, "--report", "results/report.html")
    assert html.returncode == 0, html.stderr[-3000:]
    page = (results / "report.html").read_text(errors="replace")
    assert len(page) > 100_000 and "<html" in page.lower()
    for name in ("summary.md", "summary.csv", "trust.json", *plots.NAMES.values()):
        assert name in page, name
