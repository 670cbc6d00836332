# dflash-eval: fetch -> extract -> evaluate -> report. Edit config.yaml, not this file.
import re

from snakemake.utils import min_version

from dflash_eval.config import validate_config
from dflash_eval.drafters import PRE_NORM_SUFFIX
from dflash_eval.preflight import (
    built_by,
    check_inputs,
    check_yaml_before_snakemake,
    config_source,
    warn_changed_caches,
)

min_version("9.0")

# A tab or syntax error in config.yaml named by file, line and column (Snakemake's own message names no file).
check_yaml_before_snakemake("config.yaml")


configfile: "config.yaml"


CONFIG_SOURCE = config_source(
    workflow.configfiles,
    workflow.overwrite_configfiles,
    workflow.config_settings.config,
)
config = validate_config(config, CONFIG_SOURCE)


report: "workflow/report/workflow.rst"


# A name is one of config.yaml's (step directories expanded), so a path matches one rule, one way.
wildcard_constraints:
    drafter="|".join(re.escape(name) for name in config["drafters"]),
    dataset="|".join(re.escape(name) for name in config["datasets"]),
    layerset=rf"L\d+(?:-\d+)*(?:{re.escape(PRE_NORM_SUFFIX)})?",


include: "workflow/rules/common.smk"
include: "workflow/rules/server.smk"


if config["demo"]["enabled"]:

    include: "workflow/rules/demo.smk"


# Every path and checkpoint the config names, before any job runs (what the demo rules build may be missing).
check_inputs(
    config,
    CONFIG_SOURCE,
    built_by(f for r in workflow.rules for f in r.output),
    unbuilt_demo,
)


include: "workflow/rules/fetch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/backends.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/report.smk"


warn_changed_caches(
    report_caches()
)  # shards modified after extraction, seen by `snakemake -n`


# Besides the report, every intermediate it is made from: one that went missing (an interrupted --forcerun removed
# it) is rebuilt by a plain `snakemake`, and the report after it. Named only as the report's input, Snakemake
# would leave it missing behind a newer report ("Nothing to be done").
rule all:
    default_target: True
    input:
        (
            selected_evaluations()
            if config["only"] or config["only_datasets"]
            else [rules.report.output, report_intermediates()]
        ),


onsuccess:
    finish_server()


onerror:
    finish_server()
