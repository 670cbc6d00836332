# Stage 4: summary tables and plots over every drafter x dataset.


rule report:
    input:
        metrics=expand(f"{RESULTS}/eval/{{drafter}}/{{dataset}}/metrics.json", drafter=list(config["drafters"]),
                       dataset=list(config["datasets"])),
        samples=expand(f"{RESULTS}/eval/{{drafter}}/{{dataset}}/samples.csv", drafter=list(config["drafters"]),
                       dataset=list(config["datasets"])),
    output:
        csv=f"{RESULTS}/summary.csv",
        md=f"{RESULTS}/summary.md",
        plot=f"{RESULTS}/plots/tau.png",
    params:
        settings=settings_param(cfg.report_settings(config)),
        code=code_fingerprint("report"),
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "dflash-eval --log {log} report --settings {params.settings:q} --metrics {input.metrics}"
        " --csv {output.csv} --md {output.md} --plot {output.plot} 2>> {log}"
