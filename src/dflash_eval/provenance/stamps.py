"""Outputs stamped with the code identity that made them, and read back: checks compare stamps, not the checkout.

A stage writes its identity (provenance/identity.py) into what it makes: the cache manifest, metrics.json, the
report's trust.json; a serving profile and a metrics.json's speedup section carry the estimate code's identity. A
completions file, whose records keep their own format, has its stamp beside it (`side_stamp_path`: a file Snakemake
does not track, so writing it reruns nothing; a file without one is unstamped). The workflow passes the identity it planned with as DFLASH_EVAL_CODE; a stage whose code changed between the plan and
its run says so, and stamps what really ran.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dflash_eval.io_utils import atomic_write_json
from dflash_eval.provenance.identity import AUTO, stage_identity

log = logging.getLogger(__name__)

STAMP = "code_identity"  # the key of the stamp in each stamped JSON output
PLANNED = "DFLASH_EVAL_CODE"  # the identity the workflow planned the job with (workflow/rules/common.smk)


def stage_stamp(stage: str, engine: str = AUTO) -> str:
    """The identity to stamp `stage`'s outputs with: the code that runs now (fetch's for server.engine `engine`)."""
    current = stage_identity(stage, engine)
    planned = os.environ.get(PLANNED)
    if planned and planned.split(".", 1)[0] == stage and planned != current:
        log.warning(
            "this %s job was planned with code %s but runs %s (the code changed meanwhile): its outputs are "
            "stamped with the code that ran, and `dflash-eval status` names them",
            stage,
            planned,
            current,
        )
    return current


def side_stamp_path(output: str | Path) -> Path:
    """Where the stamp of an output that cannot hold one (a completions file) lies: `<output>.stamp.json`."""
    output = Path(output)
    return output.with_name(output.name + ".stamp.json")


def write_side_stamp(output: str | Path, stage: str, engine: str = AUTO) -> None:
    """Stamp `output` beside it with the code that runs now, and the server.engine it was planned for."""
    atomic_write_json(side_stamp_path(output), {STAMP: stage_stamp(stage, engine), "engine": engine})


def side_engine(output: str | Path) -> str:
    """The server.engine a side stamp names (auto for none)."""
    try:
        data: Any = json.loads(side_stamp_path(output).read_text())
    except (OSError, ValueError):
        return AUTO
    engine = data.get("engine") if isinstance(data, dict) else None
    return engine if isinstance(engine, str) else AUTO


def read_stamp(path: str | Path) -> str | None:
    """The code identity a stamped JSON output (a cache directory's manifest.json, a completions file's side
    stamp) records; None if none."""
    path = Path(path)
    if path.suffix == ".jsonl":
        path = side_stamp_path(path)
    elif path.is_dir():
        path = path / "manifest.json"
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    value = data.get(STAMP) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
