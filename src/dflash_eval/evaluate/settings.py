"""The evaluate stage's settings from config.yaml, beside the stage: one drafter on one dataset (its rule's params)."""

from __future__ import annotations

from dflash_eval.config import CHECKPOINT_KEYS, EVALUATION_JOB_KEYS, stage_builder
from dflash_eval.drafters import drafter_last_layer, drafter_layer_ids


@stage_builder("evaluate")
def evaluate_settings(config: dict, drafter: str, dataset: str) -> dict:
    spec = config["drafters"][drafter]
    checkpoint = {key: spec[key] for key in CHECKPOINT_KEYS}
    checkpoint["layer_ids"] = drafter_layer_ids(config, drafter)
    checkpoint["last_layer"] = drafter_last_layer(config, drafter)
    return {
        "drafter": drafter,
        "dataset": dataset,
        "checkpoint": checkpoint,
        "target": {"path": config["target"]["path"]},
        "max_tokens": config["fetch"]["max_tokens"],
        # the drafter's step timing; not the user's profile, which only the report reads (report/speedup.py)
        "speedup": {key: value for key, value in config["speedup"].items() if key != "profile"},
        **{key: value for key, value in config["evaluation"].items() if key not in EVALUATION_JOB_KEYS},
    }
