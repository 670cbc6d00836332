"""trust.json's `inputs_code_identity`: the code that made each output the report was made from, by their stamps
(trust.json's own `code_identity` is the report's)."""

from __future__ import annotations

from typing import Any

from dflash_eval.provenance.stamps import STAMP, read_stamp
from dflash_eval.report.metrics_files import Evaluation


def stamps_panel(evaluations: list[Evaluation], caches: list[str]) -> dict[str, Any]:
    """Each evaluation's and each cache's identity (None: made before stamps)."""
    return {
        "evaluations": {f"{e.key[0]}/{e.key[1]}": e.metrics.get(STAMP) for e in evaluations},
        "caches": {str(cache): read_stamp(cache) for cache in caches},
    }


def lines(report_stamp: str, inputs: dict[str, Any]) -> list[str]:
    """summary.md's "Made by" section: which code identity made the report and, grouped, its inputs, so that a
    page read later says whether its numbers came from one version of the code."""
    out = ["## Made by", "", f"- this report: `{report_stamp}`"]
    for what, stamps in (("evaluations", inputs["evaluations"]), ("hidden-state caches", inputs["caches"])):
        counts: dict[str, int] = {}
        for stamp in stamps.values():
            key = f"`{stamp}`" if stamp else "made before stamps"
            counts[key] = counts.get(key, 0) + 1
        shown = "; ".join(f"{key} ({count})" for key, count in sorted(counts.items()))
        out.append(f"- {what}: {shown or 'none'}")
    out += ["", "`dflash-eval status` names every output that other code made (docs/reruns.md)."]
    return out
