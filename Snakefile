# dflash-eval: fetch -> extract -> evaluate -> report. Edit config.yaml, not this file.
import re

from snakemake.utils import min_version

from dflash_eval.config import validate_config

min_version("9.0")


configfile: "config.yaml"


config = validate_config(config, "config.yaml (plus any --config overrides)")


report: "workflow/report/workflow.rst"


# A name is one of config.yaml's (step directories expanded), so a path matches one rule, one way.
wildcard_constraints:
    drafter="|".join(re.escape(name) for name in config["drafters"]),
    dataset="|".join(re.escape(name) for name in config["datasets"]),
    layerset=r"L\d+(?:-\d+)*",


include: "workflow/rules/common.smk"
include: "workflow/rules/server.smk"


if config["demo"]["enabled"]:

    include: "workflow/rules/demo.smk"


include: "workflow/rules/fetch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        selected_evaluations() if config["only"] or config["only_datasets"] else rules.report.output,


onsuccess:
    finish_server()


onerror:
    finish_server()
