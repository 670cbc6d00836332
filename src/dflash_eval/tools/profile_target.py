"""The profile_target rule's stage: the target timed once per target, device, dtype and kernel backend.

The expected speedup needs the target's serving step (T_AR, T_verify(n)); it does not depend on a dataset or a
layer set, so one job times it (tools/target_timing.py) and writes one profile, stamped with its code identity
and the estimate code's. The report (and each export) makes the estimate from it and each metrics.json (tau and
the drafter's own step time), so a re-timed target reruns no extraction and no evaluation.

Settings (the rule's params, `params`): the target (path, dtype, device, backend), speedup's context_tokens and
repeats, and what picks the sizes to time: evaluation's block_sizes and ddtree_budgets, and the configured
drafters' config.json files, whose `block_size` is read when the job runs. How the job runs around the server
(`--runtime`, the extract rule's: the server it pauses while the target is loaded) reruns nothing.
This module imports no torch at load: the Snakefile reads `wanted`, `params` and `profile_path` from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path
from typing import Any

from dflash_eval.config import RUNTIME_HELP, with_runtime
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object

log = logging.getLogger(__name__)

SETTINGS_KEYS = ("target", "context_tokens", "repeats", "block_sizes", "ddtree_budgets", "drafter_configs")


def wanted(config: dict[str, Any]) -> bool:
    """Whether the workflow times the target: no `speedup.profile` of the user's, and speedup.measure true, or auto
    on a CUDA device (a CPU step says nothing about serving: speedup/timing.py's `wanted`, by the device's name)."""
    speedup = config["speedup"]
    if speedup.get("profile"):
        return False
    measure = speedup.get("measure", "auto")
    return measure is True or (measure == "auto" and str(config["target"]["device"]).startswith("cuda"))


def profile_path(config: dict[str, Any], results: str) -> str:
    """`results/profile/<target dir>/<device>-<dtype>-<backend>.json`: one profile per target, device, dtype and
    backend (the device's `:` left out of the name)."""
    target = config["target"]
    name = Path(str(target["path"]).rstrip("/")).name or "target"
    key = "-".join(re.sub(r"[^A-Za-z0-9_.]", "", str(target[k])) for k in ("device", "dtype", "backend"))
    return f"{results}/profile/{name}/{key}.json"


def drafter_config(spec: dict[str, Any]) -> str:
    """Where a configured drafter's config.json is (its `config`, else beside its weights)."""
    if spec.get("config"):
        path = str(spec["config"])
        return path if path.endswith(".json") else f"{path}/config.json"
    path = Path(spec["path"])
    return str((path.parent if path.suffix else path) / "config.json")


def params(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the profile: the rule's params (a change re-times the target, and reruns only the report)."""
    target, evaluation, speedup = config["target"], config["evaluation"], config["speedup"]
    return {
        "target": {key: target[key] for key in ("path", "dtype", "device", "backend")},
        "context_tokens": speedup["context_tokens"],
        "repeats": speedup["repeats"],
        "block_sizes": evaluation.get("block_sizes"),
        "ddtree_budgets": evaluation.get("ddtree_budgets"),
        "drafter_configs": sorted({drafter_config(spec) for spec in config["drafters"].values()}),
    }


def drafter_blocks(configs: list[str]) -> list[int] | None:
    """Each drafter's own block size, from its config.json; None when one cannot be read (then every block a
    drafter of block <= 16 might verify is timed: tools/target_timing.py's sizes_to_measure)."""
    blocks = []
    for path in configs:
        try:
            data = read_json_object(Path(path))
        except (OSError, ValueError, DflashEvalError):
            log.info("%s: not readable, so its block size is not known: timing every chain block 2..16", path)
            return None
        block = data.get("block_size")
        if not isinstance(block, int) or block < 1:
            log.info("%s: no block_size, so timing every chain block 2..16", path)
            return None
        blocks.append(block)
    return sorted(set(blocks))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", required=True, help="the profile_target rule's params as JSON (params())")
    parser.add_argument("--runtime", help=RUNTIME_HELP)
    parser.add_argument(
        "--out", required=True, help="the profile, results/profile/<target>/<device>-<dtype>-<backend>.json"
    )


def checked(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings with every key named, no unknown one (a typo is loud)."""
    missing = [k for k in ("target", "context_tokens", "repeats") if k not in settings]
    unknown = sorted(set(settings) - {*SETTINGS_KEYS, "server"})
    if missing or unknown:
        raise DflashEvalError(
            f"profile-target settings: missing {missing}, unknown {unknown} (the keys: "
            f"{', '.join(SETTINGS_KEYS)}, and server from --runtime)"
        )
    return settings


def profile_target(settings: dict[str, Any], out: str | Path) -> dict[str, Any]:
    """Load the target with the server paused, time it, write the stamped profile."""
    import torch

    from dflash_eval.cache.serving_profile import ESTIMATE_STAMP
    from dflash_eval.extract.backends import use_backend
    from dflash_eval.extract.target import load_target
    from dflash_eval.provenance.identity import estimate_code_hash
    from dflash_eval.provenance.stamps import STAMP, stage_stamp
    from dflash_eval.server.control import server_paused
    from dflash_eval.tools.target_timing import sizes_to_measure, write_target_profile

    target = settings["target"]
    options = {
        "context_tokens": settings["context_tokens"],
        "repeats": settings["repeats"],
        "block_sizes": settings.get("block_sizes"),
        "ddtree_budgets": settings.get("ddtree_budgets"),
        "drafter_blocks": drafter_blocks(settings.get("drafter_configs") or []),
        "kernel_backend": target["backend"],
    }
    log.info(
        "timing the target at %d sizes: %s",
        len(sizes_to_measure(options)),
        ", ".join(map(str, sizes_to_measure(options))),
    )
    options["stamps"] = {
        STAMP: stage_stamp("profile-target"),
        ESTIMATE_STAMP: estimate_code_hash(),
        "dtype": target["dtype"],
        "backend": target["backend"],
    }
    device = torch.device(target["device"])
    with server_paused(settings["server"]) if settings.get("server") else _no_server():
        try:
            model, _ = load_target(target["path"], target["dtype"], target["device"])
            with use_backend(target["backend"], target["device"], model):
                profile = write_target_profile(model, out, options)
            del model
        finally:
            if device.type == "cuda":
                import gc

                gc.collect()
                torch.cuda.empty_cache()
    return profile


def _no_server():
    from contextlib import nullcontext

    log.warning("no server settings (the workflow passes them as --runtime JSON): no inference server is paused")
    return nullcontext()


def run(args: argparse.Namespace) -> int:
    try:
        settings = json.loads(args.settings)
    except json.JSONDecodeError as error:
        raise DflashEvalError(f"--settings is not valid JSON ({error})") from error
    profile_target(checked(with_runtime(settings, args.runtime)), args.out)
    return 0
