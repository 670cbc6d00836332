# dflash-eval: fetch -> extract -> evaluate -> report. Edit config.yaml, not this file.
import json
from pathlib import Path

from dflash_eval.config import validate_config

configfile: "config.yaml"

config = validate_config(config, "config.yaml (plus any --config overrides)")


include: "workflow/rules/common.smk"
include: "workflow/rules/server.smk"
include: "workflow/rules/demo.smk"
include: "workflow/rules/fetch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        selected_evaluations() if config.get("only") or config.get("only_datasets") else rules.report.output,


onsuccess:
    finish_server()


onerror:
    finish_server()
