"""serving_profile.json: one serving step's cost, the one place that checks and reads the file.

The profile_target rule writes one per target, device, dtype and backend (tools/profile_target.py), or a user
names their own, measured on their deployment, as `speedup.profile` (then the target is not timed); the report
and each export read either (report/speedup.py). Only JSON here, no torch, so that the workflow can check a
user's file at load. Fields:
    t_ar_ms       the target's decode step of one token, ms (required, > 0)
    t_verify_ms   {"<n tokens>": ms, ...} the target verifying n tokens (required; n >= 1). Only the
                  listed n count: a method verifying another n gets no estimate (never interpolated)
    t_draft_ms    the drafter's block forward with its LM head, ms (optional: timed at evaluation)
    t_step_ms     {"<b>": ms, ...} optional: a whole speculative step (draft + verify) at chain block b,
                  measured on a server with forced acceptance (docs/speedup.md); used as is for chain-B<b>
    hybrid        true for a Gated DeltaNet hybrid target (optional; the DDTree estimate then says
                  what it assumes: speedup/model.py)
    context_tokens, source, device, spread   (optional, informational)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object


def _positive(path: Path, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise DflashEvalError(f"{path}: field {field!r} must be a positive number of milliseconds, got {value!r}")
    return float(value)


def _sizes(path: Path, field: str, table: Any) -> dict[int, float]:
    """{"<tokens>": ms} checked, keyed by int and sorted."""
    if not isinstance(table, dict) or not table:
        raise DflashEvalError(f'{path}: field {field!r} must be an object {{"<tokens>": ms}} with at least one entry')
    sizes = {}
    for key, value in table.items():
        try:
            tokens = int(key)
        except (TypeError, ValueError):
            tokens = 0
        if tokens < 1 or str(tokens) != str(key).strip():
            raise DflashEvalError(f"{path}: field {field!r} key {key!r} must be a token count >= 1")
        sizes[tokens] = _positive(path, f"{field}.{key}", value)
    return dict(sorted(sizes.items()))


def check_profile(data: Any, path: str | Path) -> dict[str, Any]:
    """A profile with its fields checked and t_verify_ms keyed by int; errors name the file and field."""
    path = Path(path)
    if not isinstance(data, dict):
        raise DflashEvalError(f"{path}: a serving profile is a JSON object with t_ar_ms and t_verify_ms")
    for required in ("t_ar_ms", "t_verify_ms"):
        if required not in data:
            raise DflashEvalError(f"{path}: field {required!r} is missing (see {__name__}'s docstring for the format)")
    profile = {
        **data,
        "t_ar_ms": _positive(path, "t_ar_ms", data["t_ar_ms"]),
        "t_verify_ms": _sizes(path, "t_verify_ms", data["t_verify_ms"]),
    }
    if data.get("t_step_ms") is not None:
        profile["t_step_ms"] = _sizes(path, "t_step_ms", data["t_step_ms"])
    if data.get("hybrid") is not None and not isinstance(data["hybrid"], bool):
        raise DflashEvalError(
            f"{path}: field 'hybrid' must be true or false (a Gated DeltaNet hybrid target), got {data['hybrid']!r}"
        )
    if data.get("t_draft_ms") is not None:
        profile["t_draft_ms"] = _positive(path, "t_draft_ms", data["t_draft_ms"])
    return profile


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise DflashEvalError(f"{path}: serving profile not found (speedup.profile in config.yaml)")
    return check_profile(read_json_object(path), path)


ESTIMATE_STAMP = (
    "estimate_code"  # a measured profile's stamp: the estimate code that timed it (tools/profile_target.py)
)
