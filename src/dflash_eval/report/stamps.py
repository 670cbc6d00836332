"""trust.json's `code_identity`: the code that made the report and each output it was made from, by their stamps."""

from __future__ import annotations

from typing import Any

from dflash_eval.provenance.stamps import STAMP, read_stamp, stage_stamp
from dflash_eval.report.summary import Evaluation


def stamps_panel(evaluations: list[Evaluation], caches: list[str]) -> dict[str, Any]:
    """The report's own identity, each evaluation's and each cache's (None: made before stamps)."""
    return {"report": stage_stamp("report"),
            "evaluations": {f"{e.key[0]}/{e.key[1]}": e.metrics.get(STAMP) for e in evaluations},
            "caches": {str(cache): read_stamp(cache) for cache in caches}}
