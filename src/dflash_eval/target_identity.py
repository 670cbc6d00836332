"""The target's identity and the device it runs on: config.json, its hash, weight files, CUDA build checks.

Shared ground below the stages: the workflow reads these for the target when it loads (before any job
runs), the extract stage writes the config hash into the cache's manifest and the evaluate stage checks
a cache against it; all go through here. Torch is imported only by `parse_device`, when it is called.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object, safetensors_header

if TYPE_CHECKING:
    import torch

# config.json keys that record provenance, not the model
_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "architectures"})
_FIX = "copy the target's files again (a copy or download that stopped leaves them short)"


def read_config_json(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, with an error that names the path."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise DflashEvalError(f"{config_file} not found: target.path must be a Hugging Face model directory")
    return read_json_object(config_file)


def text_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a (possibly multimodal) config.json, provenance keys dropped."""
    text = config.get("text_config", config)
    return {k: v for k, v in text.items() if k not in _VOLATILE_KEYS}


def target_config_hash(path: str | Path) -> str:
    """sha256 of the canonical JSON of the target's text config (as written in config.json).

    Raw JSON rather than transformers' parsed config, so the hash does not move when a new
    transformers release adds default fields.
    """
    canonical = json.dumps(text_config_dict(read_config_json(path)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_is_a_target(root: Path, config: dict[str, Any]) -> None:
    """A drafter checkpoint given as the target would otherwise pass every file check and fail only at fetch,
    as a server that does not start: refuse it here, naming what the directory holds."""
    architectures = config.get("architectures") or []
    if "dflash_config" in config or any("DFlash" in str(name) for name in architectures):
        raise DflashEvalError(
            f"{root} holds a DFlash drafter ({', '.join(map(str, architectures)) or 'dflash_config in config.json'}), "
            "not a target model: point target.path at the target's Hugging Face directory and list the drafter "
            "under drafters:"
        )
    if architectures and not any(
        str(name).endswith(("ForCausalLM", "ForConditionalGeneration")) for name in architectures
    ):
        raise DflashEvalError(
            f"{root}/config.json: architectures {architectures} name no causal language model (*ForCausalLM or "
            "*ForConditionalGeneration): target.path must be the target model's directory"
        )


def check_target_dir(path: str | Path) -> dict[str, Any]:
    """The target's text config, once its directory, config.json and every safetensors file are whole
    (headers read, sizes checked; no weight is read)."""
    root = Path(path)
    if not root.is_dir():
        raise DflashEvalError(
            f"{root} {'is not a directory' if root.exists() else 'does not exist'}: "
            "target.path must be a Hugging Face model directory"
        )
    config = read_config_json(root)
    _check_is_a_target(root, config)
    text = text_config_dict(config)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DflashEvalError(f"{index}: not a safetensors index (no weight_map); {_FIX}") from None
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise DflashEvalError(
            f"{root}: no model.safetensors or model.safetensors.index.json; "
            "the target must be a Hugging Face directory with safetensors weights"
        )
    for name in files:
        if not (root / name).is_file():
            raise DflashEvalError(f"{index} lists {name}, which is not in {root}; {_FIX}")
        safetensors_header(root / name, _FIX)
    return text


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built with (None: a CPU-only build), without importing torch.

    Importing torch costs seconds at every workflow start; its generated `torch/version.py` states it.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    version_file = Path(spec.origin).parent / "version.py"
    match = (
        re.search(r"^cuda\b[^=]*=\s*(.+)$", version_file.read_text(), re.MULTILINE) if version_file.is_file() else None
    )
    if match is None:  # an unusual build: ask torch itself
        import torch

        return torch.version.cuda
    value = match.group(1).strip()
    return None if value == "None" else value.strip("'\"")


def cuda_build_problem(device: str, key: str) -> str | None:
    """Why `device` (cpu, cuda[:N]) cannot be used with the installed torch's build, or None."""
    if not str(device).startswith("cuda") or torch_cuda_version() is not None:
        return None
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return (
        f"{key} is {device}, but the installed torch ({version}) is built without CUDA; install a CUDA build "
        "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128) or set it to cpu"
    )


def parse_device(device: str | torch.device, key: str = "device") -> torch.device:
    """One device, 'cpu' or 'cuda[:N]', checked to exist; `key` names the setting in the errors."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        problem = cuda_build_problem(str(device), key)
        if problem:
            raise DflashEvalError(problem)
        if not torch.cuda.is_available():
            raise DflashEvalError(f"{key} {device} requested but torch sees no CUDA device; use 'cpu' or a GPU machine")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise DflashEvalError(f"{key} {device} requested but only {torch.cuda.device_count()} CUDA devices exist")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise DflashEvalError(f"{key} {device}: only 'cpu' and 'cuda[:N]' are supported")
    return device
