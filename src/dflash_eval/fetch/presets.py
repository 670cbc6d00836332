"""Named prompt sets: the public benchmarks DFlash reports, prompted the way its own benchmark prompts them.

A tau measured on "GSM8K" is only comparable with the published one if the prompts are the same
text, so each preset follows the DFlash authors' benchmark script: z-lab/dflash, `dflash/benchmark.py`
(its `DATASETS` table, commit 44947fb): the same hub dataset, config and split, and the same
user-message template. The message is the only one (no system prompt); the target's chat template,
with `fetch.chat_template_kwargs`, renders it as for any prompt file. MT-Bench is multi-turn: each
row's turns are answered in order, each answer feeding the next turn. The subset (`max_samples`,
`seed`) is ours (prompts.select_subset), so a subset is not the one z-lab's shuffle picks.

Rows come from the hub through `datasets.load_dataset` (`pip install 'dflash-eval[presets]'`), or,
offline, from a local copy (`source`): a .parquet / .jsonl / .json file of the split, a directory
holding such files (a hub snapshot, e.g. `hf download --repo-type dataset openai/gsm8k --local-dir
DIR`), or a `Dataset.save_to_disk` directory. Each row becomes one prompt-file record, checked by
the same code as a prompt file's lines.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch.prompts import (
    Prompt,
    json_lines,
    note_unique_id,
    prompt_from_record,
)

REASON_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INTRO = "Write a solution to the following problem and make sure that it passes the tests:\n"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class Preset:
    """Where a benchmark lives on the hub, and how one of its rows becomes the user's turns."""

    hub_id: str
    config: str | None
    split: str
    columns: tuple[str, ...]  # the columns `turns` reads (checked, so a wrong file is named, not half-read)
    turns: Callable[[dict[str, Any]], list[str]]
    record_id: Callable[[dict[str, Any], int], str]  # row, 0-based row index -> prompt id
    multi_turn: bool = False  # records of turns answered in order ("<id>#<turn>"), not one message


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset(
        "openai/gsm8k",
        "main",
        "test",
        ("question",),
        lambda row: [row["question"] + REASON_BOXED],
        lambda row, i: f"gsm8k-{i}",
    ),
    "math500": Preset(
        "HuggingFaceH4/MATH-500",
        None,
        "test",
        ("problem",),
        lambda row: [row["problem"] + REASON_BOXED],
        lambda row, i: f"math500-{i}",
    ),
    "humaneval": Preset(
        "openai/openai_humaneval",
        None,
        "test",
        ("task_id", "prompt"),
        lambda row: [f"{HUMANEVAL_INTRO}```python\n{row['prompt']}\n```"],
        lambda row, i: str(row["task_id"]),
    ),
    "mbpp": Preset(
        "google-research-datasets/mbpp",
        "sanitized",
        "test",
        ("task_id", "prompt"),
        lambda row: [row["prompt"]],
        lambda row, i: f"mbpp-{row['task_id']}",
    ),
    "mt-bench": Preset(
        "HuggingFaceH4/mt_bench_prompts",
        None,
        "train",
        ("prompt_id", "prompt"),
        lambda row: list(row["prompt"]),
        lambda row, i: f"mt-bench-{row['prompt_id']}",
        multi_turn=True,
    ),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DflashEvalError(f"unknown prompt preset {name!r}; one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def how_to_copy(name: str) -> str:
    """The fix for a machine without a hub, spelled out for this preset."""
    p = preset(name)
    subset = f"'{p.hub_id}'" + (f", '{p.config}'" if p.config else "")
    return (
        f"on a machine with hub access run `hf download --repo-type dataset {p.hub_id} --local-dir DIR` (or, in "
        f"Python, `datasets.load_dataset({subset}, split='{p.split}').save_to_disk('DIR')`), copy DIR here and set "
        f"`source: DIR` in this dataset's entry of config.yaml (a .parquet or .jsonl file of the {p.split!r} split "
        "works too)"
    )


def _optional_import(module: str, source: Path, what: str) -> Any:
    """`module`, or an error naming the source and both fixes (the presets extra, or a .jsonl copy)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DflashEvalError(
            f"{source}: reading {what} needs the `{module.split('.')[0]}` package: pip install 'dflash-eval[presets]', "
            "or convert the split to a .jsonl file (one JSON row per line) and point source at that"
        ) from None


def _read_file(path: Path) -> list[dict[str, Any]]:
    """Rows of one data file, without `datasets` (importing it costs seconds; these formats need no more)."""
    if path.suffix == ".parquet":
        pq = _optional_import("pyarrow.parquet", path, "a .parquet file")
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [row for _, row in json_lines(path, text.splitlines(), DflashEvalError)]


def _split_files(root: Path, p: Preset) -> list[Path]:
    """The data files of the preset's split in a directory (a hub snapshot): `<split>.jsonl`,
    `<split>-00000-of-00001.parquet`, ..., preferring those under a folder named after the config."""
    found = sorted(
        f
        for f in root.rglob("*")
        if f.is_file() and f.suffix in DATA_SUFFIXES and (f.stem == p.split or f.stem.startswith(p.split + "-"))
    )
    if p.config:
        in_config = [f for f in found if p.config in f.relative_to(root).parts[:-1]]
        found = in_config or found
    folders = {f.parent for f in found}
    if len(folders) > 1:
        listed = ", ".join(str(d.relative_to(root)) for d in sorted(folders))
        raise DflashEvalError(f"{root}: the {p.split!r} split is in several folders ({listed}); set source to one file")
    return found


def _load_local(name: str, source: Path) -> list[dict[str, Any]]:
    p = preset(name)
    if not source.exists():
        raise DflashEvalError(f"preset {name}: source {source} does not exist; {how_to_copy(name)}")
    if source.is_file():
        if source.suffix not in DATA_SUFFIXES:
            raise DflashEvalError(f"preset {name}: source {source} is not a {'/'.join(DATA_SUFFIXES)} file")
        return _read_file(source)
    if any((source / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
        datasets = _optional_import("datasets", source, "a save_to_disk directory (Arrow files)")
        data = datasets.load_from_disk(str(source))
        if isinstance(data, datasets.DatasetDict):
            if p.split not in data:
                raise DflashEvalError(f"preset {name}: {source} has splits {list(data)}, not {p.split!r}")
            data = data[p.split]
        return data.to_list()
    files = _split_files(source, p)
    if not files:
        raise DflashEvalError(
            f"preset {name}: no {'/'.join(DATA_SUFFIXES)} file of the {p.split!r} split under {source} "
            f"(expected e.g. {p.split}.jsonl or {p.config or 'data'}/{p.split}-00000-of-00001.parquet)"
        )
    return [row for f in files for row in _read_file(f)]


def _load_hub(name: str, cache_dir: str | None) -> list[dict[str, Any]]:
    p = preset(name)
    try:
        import datasets
    except ImportError:
        raise DflashEvalError(
            f"preset {name} without a source needs the `datasets` package: pip install 'dflash-eval[presets]'; "
            f"or {how_to_copy(name)}"
        ) from None
    try:
        data = datasets.load_dataset(p.hub_id, p.config, split=p.split, cache_dir=cache_dir)
    except Exception as exc:  # ConnectionError, DatasetNotFoundError, offline mode, ...: all mean "not here"
        where = f"{p.hub_id}" + (f" ({p.config})" if p.config else "") + f", split {p.split}"
        raise DflashEvalError(
            f"preset {name}: cannot load {where} from the Hugging Face hub or the datasets cache"
            f"{' ' + cache_dir if cache_dir else ''} ({type(exc).__name__}: {exc}). {how_to_copy(name)}"
        ) from None
    return data.to_list()


def load_preset(name: str, source: str | Path | None = None, cache_dir: str | None = None) -> list[Prompt]:
    """The preset's prompts, in the dataset's row order: from `source` when given, else the hub."""
    p = preset(name)
    rows = _load_local(name, Path(source)) if source is not None else _load_hub(name, cache_dir)
    origin = str(source) if source is not None else p.hub_id
    if not rows:
        raise DflashEvalError(f"preset {name}: {origin} has no rows")
    prompts: list[Prompt] = []
    first: dict[Any, str] = {}
    for i, row in enumerate(rows):
        where = f"preset {name}, {origin} row {i}"
        missing = [c for c in p.columns if c not in row]
        if missing:
            raise DflashEvalError(
                f"{where}: no column {missing} (the {name} preset reads {list(p.columns)}; the row has {sorted(row)}): "
                f"is this {p.hub_id}" + (f" ({p.config})" if p.config else "") + "?"
            )
        turns = p.turns(row)
        rec: dict[str, Any] = {"id": p.record_id(row, i)}
        if p.multi_turn:
            rec["turns"] = turns
        else:
            rec["messages"] = [{"role": "user", "content": turns[0]}]
        prompts.append(prompt_from_record(rec, where))
        note_unique_id(first, prompts[-1], where)
    return prompts
