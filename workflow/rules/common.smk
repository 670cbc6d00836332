# Helpers shared by the rules: settings as params, input files of targets and checkpoints.
import functools
from pathlib import Path

from dflash_eval import config as cfg
from dflash_eval.provenance.code_version import code_fingerprint
from dflash_eval.provenance.fingerprint import FingerprintCache

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
DEMO_DIR = "resources/demo"


def settings_param(settings: dict) -> str:
    """Stage settings as one canonical JSON param: one value, so Snakemake tracks it as a whole."""
    return cfg.settings_json(settings)


# How fetch and extract run (server, concurrency, timeouts), as opposed to what they produce: passed
# in the shell command from these globals, not as params, so Snakemake reruns nothing when they change
# (the code trigger sees the command's template, not its values). See config.fetch_runtime.
FETCH_RUNTIME = cfg.settings_json(cfg.fetch_runtime(config))
EXTRACT_RUNTIME = cfg.settings_json(cfg.extract_runtime(config))


def model_dir_files(path: str, demo_files: list[str]) -> list[str]:
    """Files of a model directory that a rule depends on (content-tracked, not the directory mtime).

    Demo models do not exist until the demo rules build them, so their file names are known here.
    """
    root = Path(path)
    if root.is_dir() and any(root.glob("*.safetensors")):
        names = sorted({p.name for p in root.glob("*.safetensors")} | {"config.json"})
        names += [n for n in ("model.safetensors.index.json", "generation_config.json") if (root / n).exists()]
        return [str(root / n) for n in dict.fromkeys(names)]
    if path.startswith(DEMO_DIR):
        return [f"{path}/{name}" for name in demo_files]
    raise ValueError(f"{path}: not a model directory with safetensors weights (check target.path / drafters.*.path)")


# Model files that a rule of this workflow builds (the demo) are inputs, so the DAG orders their
# build first; every other model file is tracked by a content fingerprint param, hashed once and
# cached by path, size and mtime (see dflash_eval/fingerprint.py for why not Snakemake's checksums).
FINGERPRINTS = FingerprintCache()


def built_here(files: list[str]) -> bool:
    return all(f.startswith(DEMO_DIR + "/") for f in files)


@functools.cache
def target_files() -> tuple[str, ...]:
    """Listed once per Snakemake process: every fetch, extract and evaluate job asks (500+ at scale)."""
    return tuple(model_dir_files(config["target"]["path"], ["config.json", "model.safetensors", "generation_config.json"]))


def target_inputs(wildcards=None) -> list[str]:
    files = target_files()
    return list(files) if built_here(files) else []


def served_drafter_inputs(wildcards=None) -> list[str]:
    """The served drafter's files when the demo builds them: the demo's server loads it, so fetch waits for it."""
    name = (config.get("report") or {}).get("served_drafter")
    path = str(config["drafters"][name]["path"]) if name in config.get("drafters", {}) else ""
    if not path.startswith(DEMO_DIR + "/"):
        return []
    return [path] if path.endswith((".pt", ".safetensors")) else [f"{path}/model.safetensors"]


def target_fingerprint(wildcards=None) -> str:
    return _target_fingerprint()


@functools.cache
def _target_fingerprint() -> str:
    files = list(target_files())
    return "built by the workflow" if built_here(files) else FINGERPRINTS.files(files, "target.path")


def selected_evaluations() -> list[str]:
    """`--config only=... only_datasets=...`: just these evaluations, no report."""
    drafters = cfg.select(config.get("only"), list(config["drafters"]), "--config only")
    datasets = cfg.select(config.get("only_datasets"), list(config["datasets"]), "--config only_datasets")
    return expand(f"{RESULTS}/eval/{{drafter}}/{{dataset}}/metrics.json", drafter=drafters, dataset=datasets)


def checkpoint_inputs(name: str) -> list[str]:
    files = checkpoint_files(name)
    return list(files) if built_here(files) else []


@functools.cache  # per drafter, not per evaluation job
def checkpoint_fingerprint(name: str) -> str:
    files = list(checkpoint_files(name))
    return "built by the workflow" if built_here(files) else FINGERPRINTS.files(files, f"drafters.{name}.path")


@functools.cache  # per drafter: its input and its fingerprint param both ask, for every dataset
def checkpoint_files(name: str) -> tuple[str, ...]:
    spec = config["drafters"][name]
    path = spec["path"]
    if path.endswith((".pt", ".pth", ".safetensors", ".bin", ".ckpt")):
        files = [path]
    else:
        files = model_dir_files(path, ["config.json", "model.safetensors"])
    if spec.get("config"):
        config_path = spec["config"]
        files.append(config_path if config_path.endswith(".json") else f"{config_path}/config.json")
    return tuple(files)


def drafter_layerset(name: str) -> str:
    return cfg.layerset_name(cfg.drafter_layer_ids(config, name), cfg.drafter_last_layer(config, name))

