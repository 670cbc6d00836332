"""The backend comparisons (compare-backends inside the workflow) in the report: per drafter, dataset and dtype,
how far fla's states are from torch's, layer by layer, and what that does to the drafter's tau.

This is the seed's failure class made visible: a cache extracted with another Gated DeltaNet backend than the
drafter was trained with scores the drafter on states it never saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError


def load(paths: list[str]) -> list[dict[str, Any]]:
    """Each comparison (`backends/{drafter}/{dataset}/{dtype}.json`) as {drafter, dataset, dtype, result}."""
    found = []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise DflashEvalError(
                f"{path}: not a compare-backends result ({error}); rerun it: snakemake --forcerun compare_backends"
            ) from None
        drafter, dataset = Path(path).parts[-3:-1]
        found.append({"drafter": drafter, "dataset": dataset, "dtype": Path(path).stem, "result": result})
    return found


def _rows(comparison: dict[str, Any]) -> list[list[str]]:
    result = comparison["result"]
    chain = result.get("drafter", {})
    taus = chain.get("tau", {})
    first = [comparison["drafter"], comparison["dataset"], comparison["dtype"], str(result["samples"])]
    tail = [f"{taus[name]:.3f}" if name in taus else "" for name in ("fla", "torch")]
    tail.append(f"{chain['samples_differing']} of {result['samples']}" if "samples_differing" in chain else "")
    rows = []
    for index, layer in enumerate(result["layers"]):
        errors = [
            str(layer["layer"]),
            f"{layer['cos_mean']:.6f}",
            f"{layer['cos_min']:.6f}",
            f"{layer['rel_l2']:.2e}",
            f"{layer['max_abs']:.3g}",
        ]
        rows.append((first if index == 0 else [""] * 4) + errors + (tail if index == 0 else [""] * 3))
    return rows


def lines(comparisons: list[dict[str, Any]]) -> list[str]:
    """The summary's section (nothing when no comparison was asked for)."""
    if not comparisons:
        return []
    out = [
        "## Kernel backends: fla against torch on the same completions",
        "",
        "Each comparison runs the target twice over the same tokens, once with each Gated DeltaNet kernel "
        "backend, and scores the drafter's own chain on each backend's states (`dflash-eval compare-backends`).",
        "",
        "| drafter | dataset | dtype | samples | layer | cos mean | cos min | rel L2 | max abs | tau fla | tau torch "
        "| samples with other steps |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for comparison in comparisons:
        out += ["| " + " | ".join(row) + " |" for row in _rows(comparison)]
    return out + [""]
