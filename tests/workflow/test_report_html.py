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
from tests.report.fixtures import SETTINGS, metrics_dict, write_metrics, write_trust_inputs
from dflash_eval.bench.workflow import copy_workflow

REPO = Path(__file__).resolve().parents[2]
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
        "fetch": {}, "extraction": {}, "evaluation": {"bootstrap": 200},
        "datasets": {name: {"prompts": f"{name}.jsonl"} for name in SETTINGS["datasets"]},
        "drafters": {name: {"path": f"/ckpt/{name}", "layer_ids": spec["layer_ids"], "step": spec["step"]}
                     for name, spec in SETTINGS["drafters"].items()},
        "report": {key: SETTINGS[key] for key in ("reference", "served_drafter", "online_tolerance")},
    }


def report_snakemake(root: Path, *args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{repo / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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


def test_report_rule_runs_and_snakemake_report_builds_the_html(tmp_path):
    results = report_project(tmp_path)
    run = report_snakemake(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    table = pd.read_csv(results / "summary.csv")
    row = table[(table.drafter == "step-2000") & (table.dataset == "gsm8k") & (table.method == "chain-B4")].iloc[0]
    assert row.tau_mean_of_samples == metrics_dict("step-2000", "gsm8k")["chain"]["tau_mean_of_samples"]
    for name in (plot.file for plot in plots.PLOTS.values()):
        assert (results / "plots" / name).stat().st_size > 10_000
    markdown = (results / "summary.md").read_text()
    assert "| `results/hidden/gsm8k/L1-3` |" in markdown and "60.5 s in all" in markdown   # caches, outages found

    html = report_snakemake(tmp_path, "--report", "results/report.html")
    assert html.returncode == 0, html.stderr[-3000:]
    page = (results / "report.html").read_text(errors="replace")
    assert len(page) > 100_000 and "<html" in page.lower()
    for name in ("summary.md", "summary.csv", "trust.json", *(plot.file for plot in plots.PLOTS.values())):
        assert name in page, name


def test_a_new_plot_is_one_registry_entry_and_its_caption(tmp_path):
    """An entry added to PLOTS and its caption file: the rule declares it, the stage draws it, the HTML shows it."""
    repo = copy_workflow(tmp_path / "repo")
    registry = repo / "src" / "dflash_eval" / "report" / "plots.py"
    registry.write_text(registry.read_text() + '\nPLOTS["extra"] = Plot("extra.png", draw_tau, "extra.rst")\n')
    (repo / "workflow" / "report" / "extra.rst").write_text("The extra plot's own caption.\n")
    root = tmp_path / "project"
    results = report_project(root, repo)
    run = report_snakemake(root, repo=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (results / "plots" / "extra.png").read_bytes() == (results / "plots" / "tau.png").read_bytes()
    html = report_snakemake(root, "--report", "results/report.html", repo=repo)
    assert html.returncode == 0, html.stderr[-3000:]
    page = (results / "report.html").read_text(errors="replace")
    assert "extra.png" in page and "own caption" in page
