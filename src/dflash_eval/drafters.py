"""config.yaml's drafters: a directory of training checkpoints expanded into one drafter per step, and each
drafter's layer list and layer set (the name of the hidden-state cache it reads)."""

from __future__ import annotations

import re
from pathlib import Path

from dflash_eval.checkpoint import CheckpointFacts, config_file, detect_layout
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object

_STEP_NAME = re.compile(r"^(?:step|checkpoint|global_step)[_-]?(\d+)(\.pt|\.pth|\.safetensors)?$")


def step_checkpoints(path: str | Path) -> list[tuple[int, Path]]:
    """(step, checkpoint) of a training run's directory: `step_N.pt` / `step_N.safetensors` files or `step_N/`,
    `checkpoint-N/` HF dirs.

    Empty when `path` is not such a directory (a single checkpoint, or not there yet): an HF directory holds
    weights under another name (model.safetensors, its shards), while step-named files are a run's steps.
    """
    root = Path(path)
    if not root.is_dir() or any(not _STEP_NAME.match(f.name) for f in root.glob("*.safetensors")):
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_NAME.match(child.name)
        if not match:
            continue
        is_file = child.is_file() and match.group(2) is not None
        is_model_dir = child.is_dir() and match.group(2) is None and (child / "config.json").is_file()
        if is_file or is_model_dir:
            found.append((int(match.group(1)), child))
    steps = [step for step, _ in found]
    duplicates = sorted({step for step in steps if steps.count(step) > 1})
    if duplicates:
        raise DflashEvalError(f"{root}: more than one checkpoint for step(s) {duplicates}; keep one layout per step")
    return sorted(found)


def expand_step_directories(drafters: dict, source: str) -> dict:
    """A drafter naming a directory of training checkpoints becomes one drafter per step, `<name>-step<N>`.

    Evaluated at every workflow start, so a new step shows up as new jobs and nothing else.
    """
    expanded: dict = {}
    for name, spec in drafters.items():
        steps = step_checkpoints(spec["path"])
        if not steps:
            expanded[name] = spec
            continue
        config_path = spec.get("config")
        if config_path is None and (Path(spec["path"]) / "config.json").is_file():
            config_path = str(Path(spec["path"]) / "config.json")
        for step, checkpoint in steps:
            if checkpoint.is_file() and config_path is None:
                raise DflashEvalError(
                    f"{source}: drafters.{name}: {checkpoint} is a bare checkpoint; set drafters.{name}.config "
                    f"(a drafter config.json) or put config.json in {spec['path']}"
                )
            step_name = f"{name}-step{step}"
            if step_name in drafters:
                raise DflashEvalError(
                    f"{source}: drafters.{name} expands to {step_name}, which is also a drafter of its own; rename one"
                )
            expanded[step_name] = {
                **spec,
                "path": str(checkpoint),
                "step": step,
                "run": spec.get("run") or name,
                "config": None if checkpoint.is_dir() else config_path,
            }
    return expanded


PRE_NORM_SUFFIX = "-prenorm"  # a layer set whose last-layer id holds that layer's own output, not the final norm's


def layerset_name(layer_ids: list[int], last_layer: str) -> str:
    """Directory-safe, order-preserving name of a layer list: [1, 16, 31] -> L1-16-31, with the pre-norm last
    layer L1-16-31-prenorm (the target's layer count is not known at workflow load: the demo builds it)."""
    return "L" + "-".join(str(i) for i in layer_ids) + (PRE_NORM_SUFFIX if last_layer == "pre_norm" else "")


def parse_layerset(name: str) -> list[int]:
    if not name.startswith("L"):
        raise DflashEvalError(f"layer set {name!r} must look like L1-16-31")
    return [int(part) for part in name[1:].removesuffix(PRE_NORM_SUFFIX).split("-")]


def layerset_last_layer(name: str) -> str:
    """What a layer set's last-layer id holds: "pre_norm" for a name ending in -prenorm, else "final_norm"."""
    return "pre_norm" if name.endswith(PRE_NORM_SUFFIX) else "final_norm"


def drafter_last_layer(config: dict, drafter: str) -> str:
    """drafters.<name>.last_layer: what the drafter was trained on for the target's last layer."""
    return config["drafters"][drafter]["last_layer"]  # filled from the schema's default


def drafter_layer_ids(config: dict, drafter: str) -> list[int]:
    """The drafter's target layers: from config.yaml, else from its config.json when it exists now, found and read
    as the evaluation reads it (checkpoint.config_file, CheckpointFacts.layer_ids)."""
    spec = config["drafters"][drafter]
    if spec.get("layer_ids"):
        return [int(i) for i in spec["layer_ids"]]
    path = Path(spec["path"])
    try:
        layout = detect_layout(path) if spec.get("layout", "auto") == "auto" else spec["layout"]
        file = config_file(path, layout, spec.get("config"))
        ids = CheckpointFacts(path, layout, file, read_json_object(file), None).layer_ids
        why = "" if ids else f"{file} has no dflash_config.target_layer_ids"
    except DflashEvalError as error:
        ids, why = None, str(error)
    if ids:
        return ids
    raise DflashEvalError(
        f"drafters.{drafter}: cannot tell its target layers (no layer_ids in config.yaml, and {why}); "
        f"set drafters.{drafter}.layer_ids"
    )
