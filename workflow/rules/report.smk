# Stage 4: summary tables, the trust panel and plots over every drafter x dataset.
# Outputs marked report() go into `snakemake --report results/report.html`, captioned from workflow/report/.
# The plots are the registry dflash_eval.report.plots.PLOTS: a new plot is one entry there plus its caption here.
# update(): Snakemake keeps the last report while the job runs and puts it back if the job fails.
from pathlib import Path

from dflash_eval.errors import DflashEvalError
from dflash_eval.report.plots import PLOTS

EVALUATION = f"{RESULTS}/eval/{{drafter}}/{{dataset}}"   # what the evaluate rule writes: metrics.json, samples.csv


def report_caches(wildcards=None) -> list[str]:
    """Every hidden-state cache an evaluation read: the trust panel lists their provenance."""
    return sorted({f"{RESULTS}/hidden/{dataset}/{drafter_layerset(drafter)}"
                   for drafter in config["drafters"] for dataset in config["datasets"]})


def checked_report_settings(wildcards=None) -> str:
    """The report's settings, asked once each evaluation it reads exists or can be made.

    With an older report present, Snakemake plans the report even when an evaluation cannot be made
    (a drafter path that holds no model: the evaluate rule's input error is not shown), and the job
    then fails on its missing inputs with a misleading "filesystem latency" message. A param's error
    stops the run while it is planned, before any job starts, naming the cause.
    """
    for drafter in config["drafters"]:
        for dataset in config["datasets"]:
            metrics = EVALUATION.format(drafter=drafter, dataset=dataset) + "/metrics.json"
            if Path(metrics).exists():
                continue
            try:  # what the evaluate rule's inputs need (see evaluate.smk)
                checkpoint_inputs(drafter)
                target_inputs()
            except (ValueError, DflashEvalError) as error:
                raise DflashEvalError(f"the report needs {metrics} (drafter {drafter!r} on dataset {dataset!r}), "
                                      f"which does not exist and cannot be made: {error}") from None
    return settings_param(cfg.report_settings(config))


def report_output(path: str, caption: str, category: str):
    return report(update(path), caption=f"../report/{caption}", category=category)


def plot_dir(wildcards, output) -> str:
    """The plots' folder, from their declared outputs: the stage writes every registered plot there."""
    return str(Path(getattr(output, next(iter(PLOTS)))).parent)


rule report:
    input:
        metrics=expand(f"{EVALUATION}/metrics.json", drafter=list(config["drafters"]), dataset=list(config["datasets"])),
        samples=expand(f"{EVALUATION}/samples.csv", drafter=list(config["drafters"]), dataset=list(config["datasets"])),
        hidden=report_caches,
        completions=expand(f"{RESULTS}/completions/{{dataset}}.jsonl", dataset=list(config["datasets"])),
    output:
        csv=report_output(f"{RESULTS}/summary.csv", "summary_csv.rst", "Summary"),
        md=report_output(f"{RESULTS}/summary.md", "summary_md.rst", "Summary"),
        trust=report_output(f"{RESULTS}/trust.json", "trust.rst", "Summary"),
        **{name: report_output(f"{RESULTS}/plots/{plot.file}", plot.caption, "Plots") for name, plot in PLOTS.items()},
    params:
        settings=checked_report_settings,
        plot_dir=plot_dir,
        code=code_fingerprint("report"),
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "dflash-eval --log {log} report --settings {params.settings:q} --metrics {input.metrics}"
        " --hidden {input.hidden} --completions {input.completions} --csv {output.csv} --md {output.md}"
        " --trust {output.trust} --plot-dir {params.plot_dir} 2>> {log}"
