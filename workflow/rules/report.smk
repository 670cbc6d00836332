# Stage 4: summary tables, the trust panel and plots over every drafter x dataset.
# Outputs marked report() go into `snakemake --report results/report.html`, captioned from workflow/report/.


rule report:
    input:
        metrics=expand(METRICS, drafter=list(config["drafters"]), dataset=list(config["datasets"])),
        samples=expand(SAMPLES, drafter=list(config["drafters"]), dataset=list(config["datasets"])),
        hidden=report_caches,
        completions=expand(COMPLETIONS, dataset=list(config["datasets"])),
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
        plot_dir=lambda w, output: os.path.dirname(output.plot),
        code=code_fingerprint("report"),
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "dflash-eval --log {log} report --settings {params.settings:q} --metrics {input.metrics}"
        " --hidden {input.hidden} --completions {input.completions} --csv {output.csv} --md {output.md}"
        " --trust {output.trust} --plot {output.plot} --plot-dir {params.plot_dir} 2>> {log}"
