"""What a drafter checkpoint says about itself, read from its config.json and safetensors headers only.

Cheap (kilobytes, no torch), so the workflow reads it for every drafter when it loads, before any job
runs: a layer list or an fc width that contradicts the checkpoint is found before hours of extraction,
not after. The drafter loader (evaluate.drafter) goes through the same functions, so the two cannot
disagree about what a checkpoint is.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object, safetensors_header

PREFIXES = ("module.", "model.", "_orig_mod.")  # wrappers a training script may leave on every key
PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_FIX = "copy the checkpoint again, or point the drafter's path at a complete one"


@dataclass
class CheckpointFacts:
    """A checkpoint's layout, its config.json (file and contents), and its tensor shapes where the
    layout has a header to read them from (safetensors; None for a .pt, whose shapes are pickled)."""

    path: Path
    layout: str
    config_file: Path
    config: dict[str, Any]
    shapes: dict[str, list[int]] | None

    @property
    def layer_ids(self) -> list[int] | None:
        """target_layer_ids where the reference package reads them (dflash_config, else top level)."""
        ids = self.config.get("dflash_config", {}).get("target_layer_ids", self.config.get("target_layer_ids"))
        return None if ids is None else [int(i) for i in ids]


def detect_layout(path: Path) -> str:
    """hf (directory with config.json), safetensors (bare file) or pt (training checkpoint)."""
    if path.is_dir():
        return "hf"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in PT_SUFFIXES:
        return "pt"
    raise DflashEvalError(
        f"{path}: cannot tell the checkpoint layout; use a HF directory, a .safetensors file or a .pt/.pth "
        "training checkpoint, or set `layout:` for this drafter"
    )


def config_file(path: Path, layout: str, config: str | Path | None) -> Path:
    """The drafter's config.json: `config:` (a file or HF directory), the HF directory's own, or a sibling."""
    source = Path(config) if config is not None else (path if layout == "hf" else None)
    if source is None:
        source = path.parent / "config.json"
        if not source.is_file():
            raise DflashEvalError(f"{path}: a {layout} checkpoint needs `config:` (a drafter config.json or HF dir)")
    file = source / "config.json" if source.is_dir() else source
    if not file.is_file():
        raise DflashEvalError(f"drafter config {file} not found; give `config:` as a config.json or HF directory")
    return file


def weight_files(path: Path, layout: str) -> list[Path]:
    """The safetensors files of a checkpoint (the index's shards for a sharded HF directory); [] for .pt."""
    if layout == "pt":
        return []
    if layout == "safetensors":
        return [path]
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        others = sorted(p.name for p in path.glob("*.safetensors") if p != single)
        if others:  # read silently, model.safetensors alone would be evaluated whatever the others hold
            raise DflashEvalError(
                f"{path}: holds model.safetensors and also {', '.join(others)}; only "
                "model.safetensors would be read. Move the other files out of the directory (or, "
                "for a sharded checkpoint, remove model.safetensors and keep its index)"
            )
        return [single]
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DflashEvalError(f"{index}: no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DflashEvalError(f"{index} lists {', '.join(missing)}, which do not exist; {_FIX}")
        return files
    raise DflashEvalError(f"{path}: HF drafter directory has no model.safetensors (or index)")


ZIP_LOCAL_HEADER = 30  # bytes of a zip member's local header before its name (PKWARE APPNOTE 4.3.7)


def pt_archive_problem(path: Path) -> str | None:
    """Why a .pt file cannot be a whole torch checkpoint, from its size and zip directory alone (no tensor read),
    or None. torch.save writes a zip archive: its central directory sits at the end of the file, so a copy that
    stopped early has none, and each member must end inside the file. A legacy pickle file (not a zip) can only
    be checked by loading it."""
    size = path.stat().st_size
    if size == 0:
        return "0 bytes: the file is empty (a save or copy that never wrote it)"
    with open(path, "rb") as handle:
        if not b"PK".startswith(handle.read(2)):  # a zip's signature (or what a cut left of it)
            return None
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        return (
            f"{size} bytes, and its zip directory (the index torch.save writes at the end of the file) cannot be "
            f"read ({error}): the file is truncated or damaged"
        )
    for member in members:
        end = member.header_offset + ZIP_LOCAL_HEADER + len(member.filename.encode()) + member.compress_size
        if end > size:
            return f"{size} bytes, but its member {member.filename} ends at byte {end} or later: the file is truncated"
    if not any(member.filename.endswith("data.pkl") for member in members):
        return "a zip archive without data.pkl: not a torch.save checkpoint"
    return None


def checkpoint_facts(path: str | Path, layout: str = "auto", config: str | Path | None = None) -> CheckpointFacts:
    """Layout, config.json and safetensors header shapes of a drafter checkpoint; no weight is read."""
    path = Path(path)
    if not path.exists():
        raise DflashEvalError(f"drafter checkpoint {path} does not exist")
    layout = detect_layout(path) if layout == "auto" else layout
    file = config_file(path, layout, config)
    shapes = None
    if layout == "pt":
        problem = pt_archive_problem(path)
        if problem:
            raise DflashEvalError(f"{path}: {problem}; {_FIX}")
    else:
        shapes = {}
        for weights in weight_files(path, layout):
            shapes.update({name: list(entry["shape"]) for name, entry in safetensors_header(weights, _FIX).items()})
    return CheckpointFacts(path=path, layout=layout, config_file=file, config=read_json_object(file), shapes=shapes)


def strip_prefixes(names: list[str], expected: set[str]) -> dict[str, str]:
    """Checkpoint key -> model key: wrapper prefixes removed while no key matches the model's."""
    mapping = {name: name for name in names}
    changed = True
    while changed and mapping and not set(mapping.values()) & expected:
        changed = False
        for prefix in PREFIXES:
            if all(key.startswith(prefix) for key in mapping.values()):
                mapping = {name: key[len(prefix) :] for name, key in mapping.items()}
                changed = True
                break
    return mapping


def agreed_layer_ids(facts: CheckpointFacts, layer_ids: list[int] | None) -> list[int]:
    """The drafter's layer list: config.yaml's `layer_ids` must equal the checkpoint's own, if both exist."""
    own = facts.layer_ids
    if own is not None and layer_ids is not None and list(layer_ids) != own:
        raise DflashEvalError(
            f"{facts.path}: config.yaml says layer_ids {list(layer_ids)} but the drafter config ({facts.config_file}) "
            f"says target_layer_ids {own}; make them equal (the checkpoint's own list is the truth)"
        )
    ids = own if own is not None else layer_ids
    if ids is None:
        raise DflashEvalError(
            f"{facts.path}: no target_layer_ids in the drafter config; set `layer_ids:` in config.yaml"
        )
    return list(ids)


def check_fc_width(path: Path, fc_shape: list[int] | tuple[int, ...], hidden: int, layer_ids: list[int]) -> None:
    """fc.weight [hidden, n * hidden] must take exactly the listed layers: the seed write-up's silent bug."""
    if len(fc_shape) != 2 or fc_shape[1] % hidden:
        raise DflashEvalError(
            f"{path}: fc.weight {tuple(fc_shape)} in-features are not a multiple of hidden_size {hidden}"
        )
    n_layers = fc_shape[1] // hidden
    if n_layers != len(layer_ids):
        raise DflashEvalError(
            f"{path}: fc.weight {tuple(fc_shape)} takes {n_layers} target layers but target_layer_ids "
            f"{layer_ids} has {len(layer_ids)}. Set `layer_ids:` for this drafter (or dflash_config.target_layer_ids "
            f"in its config.json) to the {n_layers} layers it was trained with."
        )


def check_against_target(
    path: Path, hidden: int | None, mask_token_id: Any, target_hidden: int | None, vocab_size: int | None
) -> None:
    """The drafter borrows the target's embedding and head: its hidden size and mask token must fit them."""
    if hidden is not None and target_hidden is not None and int(hidden) != int(target_hidden):
        raise DflashEvalError(
            f"{path}: drafter hidden_size {hidden} != target hidden size {target_hidden}; "
            "this drafter was trained for another target"
        )
    if mask_token_id is not None and vocab_size is not None and not 0 <= int(mask_token_id) < int(vocab_size):
        raise DflashEvalError(
            f"{path}: mask_token_id {mask_token_id} is outside the target vocabulary (size {vocab_size})"
        )


def check_checkpoint(
    facts: CheckpointFacts,
    layer_ids: list[int] | None,
    target_text_config: dict[str, Any] | None,
) -> list[int]:
    """Every contradiction the config and headers show, without loading a weight; returns the layer list.

    What only the weights can show (missing keys, NaN) is left to the loader.
    """
    ids = agreed_layer_ids(facts, layer_ids)
    target = target_text_config or {}
    mask = facts.config.get("dflash_config", {}).get("mask_token_id", facts.config.get("mask_token_id"))
    check_against_target(
        facts.path, facts.config.get("hidden_size"), mask, target.get("hidden_size"), target.get("vocab_size")
    )
    hidden = facts.config.get("hidden_size")
    if facts.shapes is not None and hidden is not None:
        keys = strip_prefixes(list(facts.shapes), {"fc.weight"})
        fc = next((facts.shapes[name] for name, key in keys.items() if key == "fc.weight"), None)
        if fc is not None:
            check_fc_width(facts.path, fc, int(hidden), ids)
    return ids
