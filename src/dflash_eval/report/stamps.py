"""trust.json's `inputs_code_identity`: the code that made each output the report was made from, by their stamps
(trust.json's own `code_identity` is the report's)."""

from __future__ import annotations

from typing import Any

from dflash_eval.provenance.stamps import STAMP, read_stamp
from dflash_eval.report.summary import Evaluation


def stamps_panel(evaluations: list[Evaluation], caches: list[str]) -> dict[str, Any]:
    """Each evaluation's and each cache's identity (None: made before stamps)."""
    return {
        "evaluations": {f"{e.key[0]}/{e.key[1]}": e.metrics.get(STAMP) for e in evaluations},
        "caches": {str(cache): read_stamp(cache) for cache in caches},
    }
