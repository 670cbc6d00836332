"""`snakemake --report` builds the HTML report from the real report rule, on a finished tiny run.

The run includes only workflow/rules/report.smk (with common.smk) so that the metrics, caches and
completions written here are plain inputs: it takes two snakemake invocations, not the demo.
"""

from __future__ import annotations

import pandas as pd

from dflash_eval.report import plots
from tests.support.checkout import copy_workflow
from tests.support.report_inputs import metrics_dict
from tests.support.report_project import report_project, report_snakemake


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
    assert "| `results/hidden/gsm8k/L1-3` |" in markdown and "60.5 s in all" in markdown  # caches, outages found

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
