# Helpers shared by the rules: settings as params, input files of targets and checkpoints.
import subprocess
from pathlib import Path

from dflash_eval import config as cfg

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
DEMO_DIR = "resources/demo"


def settings_param(settings: dict) -> str:
    """Stage settings as one canonical JSON param: one value, so Snakemake tracks it as a whole."""
    return cfg.settings_json(settings)


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


def target_files(wildcards=None) -> list[str]:
    return model_dir_files(config["target"]["path"], ["config.json", "model.safetensors", "generation_config.json"])


def checkpoint_files(name: str) -> list[str]:
    spec = config["drafters"][name]
    path = spec["path"]
    if path.endswith((".pt", ".pth", ".safetensors", ".bin", ".ckpt")):
        files = [path]
    else:
        files = model_dir_files(path, ["config.json", "model.safetensors"])
    if spec.get("config"):
        config_path = spec["config"]
        files.append(config_path if config_path.endswith(".json") else f"{config_path}/config.json")
    return files


def drafter_layerset(name: str) -> str:
    return cfg.layerset_name(cfg.drafter_layer_ids(config, name))


def stop_launched_server() -> None:
    """End of run: stop a managed server that this workflow launched, unless told to keep it."""
    if config["server"]["kind"] == "managed" and not config["server"].get("keep_running"):
        settings = settings_param(cfg.server_settings(config))
        subprocess.run(["dflash-eval", "server", "stop-launched", "--settings", settings], check=False)
