"""The extract stage's settings from config.yaml, beside the stage: what decides a hidden-state cache (its rule's
params) and how extraction runs around the server (`--runtime`, rerunning nothing)."""

from __future__ import annotations

from dflash_eval.config import dataset_samples, server_settings, stage_builder, verify_schemes
from dflash_eval.drafters import layerset_last_layer, parse_layerset
from dflash_eval.methods import REJECTION


def extract_runtime(config: dict) -> dict:
    """How extraction (and the profile_target rule) runs around the server (see fetch_runtime): passed beside the
    params."""
    return {"server": server_settings(config)}


def extract_params(config: dict, dataset: str, layer_ids: list[int], last_layer: str) -> dict:
    """What decides a hidden-state cache: the Snakemake params of its extract job (target_logprobs only when the
    rejection scheme is asked for and the dataset samples, so that a cache without it keeps its params; at T 0 the
    scheme is target_only's and needs none: docs/sampling.md)."""
    rejection = REJECTION in verify_schemes(config["evaluation"].get("verify"))
    return {
        "dataset": dataset,
        "layer_ids": list(layer_ids),
        "last_layer": last_layer,
        "target": dict(config["target"]),
        **config["extraction"],
        **({"target_logprobs": True} if rejection and dataset_samples(config["datasets"][dataset]) else {}),
    }


@stage_builder("extract")
def extract_settings(config: dict, dataset: str, layerset: str) -> dict:
    """Everything the extract stage reads (params and runtime) for one layer set's cache (a name from
    `layerset_name`, as the extract rule has it), for running it by hand from config.yaml."""
    return {
        **extract_params(config, dataset, parse_layerset(layerset), layerset_last_layer(layerset)),
        **extract_runtime(config),
    }
