"""The fetch stage's settings from config.yaml, beside the stage: what decides a dataset's completions (its rule's
params) and how fetch runs (`--runtime`, rerunning nothing)."""

from __future__ import annotations

from dflash_eval.config import SAMPLING_KEYS, server_settings, stage_builder


def dataset_inputs(config: dict, dataset: str) -> list[str]:
    """The files a dataset's fetch reads as Snakemake inputs: a preset's local copy (none from the hub). A prompt file
    is not one: the fetch rule tracks it by its prompts as a set (params.prompts, fetch.prompts.order_free_digest),
    so that its order, a touch or a re-save rerun nothing."""
    spec = config["datasets"][dataset]
    if "prompts" in spec:
        return []
    return [spec["source"]] if spec.get("source") else []


FETCH_RUNTIME_KEYS = ("concurrency", "timeout_s", "retries", "backoff_s")


def fetch_runtime(config: dict) -> dict:
    """How fetch runs, not what it fetches: the server it talks to, concurrency, timeouts, retries.

    The workflow passes these beside the params (`--runtime`), so changing them reruns nothing: a
    rerun of fetch would throw away hours of completions, and of extraction hours of GPU time.
    """
    return {"server": server_settings(config), **{key: config["fetch"][key] for key in FETCH_RUNTIME_KEYS}}


def fetch_params(config: dict, dataset: str) -> dict:
    """What decides a dataset's completions: the Snakemake params of its fetch job."""
    spec = config["datasets"][dataset]
    # A prompt file's params carry no preset keys (source, cache_dir): only a preset's depend on them.
    where = (
        {"prompts": spec["prompts"]}
        if "prompts" in spec
        else {"preset": spec["preset"], "source": spec["source"], "cache_dir": spec["cache_dir"]}
    )
    return {
        "dataset": dataset,
        **where,
        "max_samples": spec["max_samples"],
        "seed": spec["seed"],
        "tokenizer": config["target"]["path"],
        **{key: config["fetch"][key] for key in ("endpoint", "max_tokens")},
        **{key: spec[key] for key in SAMPLING_KEYS},  # a greedy dataset's records ignore all but temperature
        "chat_template_kwargs": config["fetch"]["chat_template_kwargs"],
    }


@stage_builder("fetch")
def fetch_settings(config: dict, dataset: str) -> dict:
    """Everything the fetch stage reads (params and runtime), for running it by hand from config.yaml."""
    return {**fetch_params(config, dataset), **fetch_runtime(config)}
