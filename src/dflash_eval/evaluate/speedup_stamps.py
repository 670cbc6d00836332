"""Which estimate code made an evaluation's expected speedup: its own (the formula, the drafter's timing) and the
one that timed the target's profile. The report's validation line compares these with the validation record's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_eval.cache.serving_profile import ESTIMATE_STAMP, PROFILE_NAME
from dflash_eval.io_utils import read_json_object
from dflash_eval.provenance.identity import estimate_code_hash


def estimate_stamps(settings: dict[str, Any], hidden: str | Path) -> dict[str, str | None]:
    """metrics.json's speedup.estimate_code: `evaluation` (this run's estimate code) and `profile` (the stamp of the
    measured profile beside the cache; None for a user's profile, or one timed before stamps)."""
    measured = Path(hidden) / PROFILE_NAME
    user = bool((settings.get("speedup") or {}).get("profile"))
    profile = None if user or not measured.is_file() else (read_json_object(measured).get(ESTIMATE_STAMP)
                                                           or "unstamped (timed before stamps)")
    return {"evaluation": estimate_code_hash(), "profile": profile}
