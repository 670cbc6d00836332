"""The workflow's own offline numbers for a served drafter, in one call: extract the completions' states with the
target, then evaluate the drafter's own chain on them, as the stages would. For the fidelity benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def extract_and_evaluate(
    target: dict[str, Any],
    drafter_path: Path,
    drafter: Any,
    completions: Path,
    hidden: Path,
    dataset: str,
    target_logprobs: bool = False,
    **evaluation: Any,
) -> tuple[dict, list[dict]]:
    """(metrics, rows) of `drafter` (a loaded drafter: layer_ids, block_size) at its own block, on `completions`'
    states cached under `hidden`. `target`: path, dtype, device, backend; `evaluation`: more evaluate settings
    (verify, bootstrap). The demo's drafters were trained on torch-kernel states, so a backend mismatch is allowed:
    both sides run the backend asked, which is what these benchmarks compare."""
    from dflash_eval.config import stage_settings
    from dflash_eval.evaluate.stage import run_evaluation
    from dflash_eval.extract.stage import extract

    extract(
        {
            "dataset": dataset,
            "layer_ids": drafter.layer_ids,
            "last_layer": "final_norm",
            "target": target,
            "server": None,
            **({"target_logprobs": True} if target_logprobs else {}),
        },
        completions,
        hidden,
    )
    settings = stage_settings(
        "evaluate",
        {
            "drafter": Path(drafter_path).name,
            "dataset": dataset,
            "target": {"path": str(target["path"])},
            "checkpoint": {"path": str(drafter_path), "layer_ids": drafter.layer_ids},
            "device": target["device"],
            "dtype": target["dtype"],
            "block_sizes": [drafter.block_size],
            "ddtree_budgets": [],
            "topk": [1],
            "allow_backend_mismatch": True,
            **evaluation,
        },
    )
    return run_evaluation(settings, str(hidden), str(completions))
