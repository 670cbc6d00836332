from dflash_eval.report.failed_run import date_kept_report_before_inputs

# Stage 4: summary tables, the trust panel and plots over every drafter x dataset.
# Outputs marked report() go into `snakemake --report results/report.html`, captioned from workflow/report/.
# The plots are the registry dflash_eval.report.plots.PLOTS: a new plot is one entry there plus its caption here.
# update(): Snakemake keeps the last report while the job runs and puts it back if the job fails. A failed job
# leaves REPORT_FAILED, so the next run rebuilds the kept report (dflash_eval.report.failed_run says why).

REPORT_FAILED = f"{RESULTS}/.report_failed"
if date_kept_report_before_inputs(
    REPORT_FAILED,
    REPORT_OUTPUTS.values(),
    expand(METRICS, drafter=list(config["drafters"]), dataset=list(config["datasets"])),
):
    print(
        f"dflash-eval: the last report job failed (see {LOGS}/report.log); the report in {RESULTS}/ is the one "
        "before it, kept, and this run rebuilds it"
    )


# What users hand on from each evaluation, beside its metrics.json: the speculation profile and a reproducible
# record (dflash-eval export, src/dflash_eval/report/export.py), made from the evaluation's own files. Not an input
# of the report (summary.csv names each profile's path): `rule all` asks for them (common.smk's report_intermediates).


rule export:
    input:
        metrics=METRICS,
        samples=SAMPLES,
        completions=COMPLETIONS,
        hidden=lambda w: hidden_cache(w.drafter, w.dataset),
    output:
        profile=PROFILE,
        record=RECORD,
    log:
        f"{LOGS}/export/{{drafter}}/{{dataset}}.log",
    benchmark:
        f"{BENCH}/export/{{drafter}}/{{dataset}}.tsv"
    params:
        # the profile's buckets and bootstrap, and the settings the record keeps (the evaluation's and its fetch's)
        settings=lambda w: settings_param(
            {
                "context_buckets": config["report"]["context_buckets"],
                "bootstrap": config["evaluation"]["bootstrap"],
                "seed": config["evaluation"]["seed"],
                "evaluate": evaluate_settings(config, w.drafter, w.dataset),
                "fetch": fetch_params(config, w.dataset),
            }
        ),
    shell:
        code_prefix("export")
        + "dflash-eval --log {log} export --settings {params.settings:q} --metrics {input.metrics}"
        " --samples {input.samples} --completions {input.completions} --hidden {input.hidden}"
        " --profile {output.profile} --record {output.record} 2>> {log}"


rule report:
    input:
        metrics=expand(
            METRICS, drafter=list(config["drafters"]), dataset=list(config["datasets"])
        ),
        samples=expand(
            SAMPLES, drafter=list(config["drafters"]), dataset=list(config["datasets"])
        ),
        hidden=report_caches,
        completions=expand(COMPLETIONS, dataset=list(config["datasets"])),
        backends=backend_comparisons,
        server_profile=server_profile_inputs,
        target_profile=target_profile_inputs,
    output:
        **REPORT_OUTPUTS,
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    params:
        settings=checked_report_settings,
        plot_dir=plot_dir,
        validation=VALIDATION_RECORD,
        failed=REPORT_FAILED,
        server_profile=server_profile_arg,
        target_profile=target_profile_arg,
    shell:
        code_prefix("report")
        + "dflash-eval --log {log} report --settings {params.settings:q} --metrics {input.metrics}"
        " --hidden {input.hidden} --completions {input.completions} --csv {output.csv} --md {output.md}"
        " --trust {output.trust} --plot-dir {params.plot_dir} --backend-comparisons {input.backends} {params.server_profile} {params.target_profile} 2>> {log}"
        " || {{ date -u +%Y-%m-%dT%H:%M:%SZ > {params.failed}; exit 1; }}"
