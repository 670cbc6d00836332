"""Outputs stamped with the code identity that made them, and read back: checks compare stamps, not the checkout.

A stage writes its identity (provenance/identity.py) into what it makes: the cache manifest, metrics.json, the
report's trust.json; a serving profile and a metrics.json's speedup section carry the estimate code's identity. The
workflow passes the identity it planned with as DFLASH_EVAL_CODE; a stage whose code changed between the plan and
its run says so, and stamps what really ran.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dflash_eval.provenance.identity import stage_identity

log = logging.getLogger(__name__)

STAMP = "code_identity"  # the key of the stamp in each stamped JSON output
PLANNED = "DFLASH_EVAL_CODE"  # the identity the workflow planned the job with (workflow/rules/common.smk)


def stage_stamp(stage: str) -> str:
    """The identity to stamp `stage`'s outputs with: the code that runs now."""
    current = stage_identity(stage)
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


def read_stamp(path: str | Path) -> str | None:
    """The code identity a stamped JSON output (or a cache directory's manifest.json) records; None if none."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    value = data.get(STAMP) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
