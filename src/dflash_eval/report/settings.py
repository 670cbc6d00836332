"""The report's settings from config.yaml, beside the report: a report option and its builder change the report's
params and code alone (docs/reruns.md)."""

from __future__ import annotations

from pathlib import Path

from dflash_eval.config import prompt_set, stage_builder
from dflash_eval.drafters import drafter_layer_ids


@stage_builder("report")
def report_settings(config: dict) -> dict:
    return {
        "drafters": {
            name: {"step": spec.get("step"), "run": spec.get("run"), "layer_ids": drafter_layer_ids(config, name)}
            for name, spec in config["drafters"].items()
        },
        "drafter_order": list(config["drafters"]),  # the settings JSON sorts keys; the report keeps config order
        "datasets": list(config["datasets"]),
        "dataset_prompts": {name: prompt_set(spec) for name, spec in config["datasets"].items()},
        **config["report"],
        "transitions": str(Path(config["server"]["log_dir"]) / "transitions.jsonl"),
        "bootstrap": config["evaluation"]["bootstrap"],
        "seed": config["evaluation"]["seed"],
    }
