# Stage 4: summary tables, the trust panel and plots over every drafter x dataset.
# Outputs marked report() go into `snakemake --report results/report.html`, captioned from workflow/report/.


def report_caches(wildcards=None) -> list[str]:
    """Every hidden-state cache an evaluation read: the trust panel lists their provenance."""
    return sorted({f"{RESULTS}/hidden/{dataset}/{drafter_layerset(drafter)}"
                   for drafter in config["drafters"] for dataset in config["datasets"]})


rule report:
    input:
        metrics=expand(f"{RESULTS}/eval/{{drafter}}/{{dataset}}/metrics.json", drafter=list(config["drafters"]),
                       dataset=list(config["datasets"])),
        samples=expand(f"{RESULTS}/eval/{{drafter}}/{{dataset}}/samples.csv", drafter=list(config["drafters"]),
                       dataset=list(config["datasets"])),
        hidden=report_caches,
        completions=expand(f"{RESULTS}/completions/{{dataset}}.jsonl", dataset=list(config["datasets"])),
    output:
        csv=report(f"{RESULTS}/summary.csv", caption="../report/summary_csv.rst", category="Summary"),
        md=report(f"{RESULTS}/summary.md", caption="../report/summary_md.rst", category="Summary"),
        trust=report(f"{RESULTS}/trust.json", caption="../report/trust.rst", category="Summary"),
        plot=report(f"{RESULTS}/plots/tau.png", caption="../report/tau.rst", category="Plots"),
        step=report(f"{RESULTS}/plots/tau_vs_step.png", caption="../report/tau_vs_step.rst", category="Plots"),
        position=report(f"{RESULTS}/plots/acceptance_by_position.png", caption="../report/acceptance_by_position.rst",
                        category="Plots"),
        histogram=report(f"{RESULTS}/plots/acceptance_histogram.png", caption="../report/acceptance_histogram.rst",
                         category="Plots"),
    params:
        settings=settings_param(cfg.report_settings(config)),
        plot_dir=f"{RESULTS}/plots",
        code=code_fingerprint("report"),
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "dflash-eval --log {log} report --settings {params.settings:q} --metrics {input.metrics}"
        " --hidden {input.hidden} --completions {input.completions} --csv {output.csv} --md {output.md}"
        " --trust {output.trust} --plot {output.plot} --plot-dir {params.plot_dir} 2>> {log}"
