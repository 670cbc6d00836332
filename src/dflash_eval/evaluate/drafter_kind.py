"""Which drafters can be evaluated on sampled completions: a DFlash2 (candidate-selector) drafter cannot.

At temperature > 0 SGLang 0.5.23 samples a DFlash2 drafter's proposal: `_propose_selector_block` draws the
selector's path (`selector.sample_path` with the request's temperatures, speculative/dflash_worker_v2.py:1509-1517;
sampling is on everywhere but Ascend, :444) and verification accepts it by rejection sampling against the
selector's q (`_selector_sampling_accept` -> `accept_sampling`, :1519-1560, taken whenever a selector sample
exists, :2199-2205); `dflash_generate` samples it too. The evaluator drafts a DFlash2 block with the selector's
greedy walk, so its number at T > 0 would be a greedy-draft acceptance that no engine produces, set beside a
server's counters from another scheme. The exact expectation under the sampled selector (its path distribution
depends on each previous candidate, and SGLang's accept kernel can verify the block as a whole) is not computed
here, so such a pairing is refused at load (preflight) and again by the evaluate stage itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_eval.config import dataset_samples
from dflash_eval.errors import DflashEvalError

DFLASH2 = "DFlash2DraftModel"


def _why(drafter: str, datasets: list[str]) -> str:
    return (
        f"drafter {drafter} is a {DFLASH2}, and datasets {', '.join(datasets)} sample (temperature > 0): "
        "SGLang 0.5.23 samples a DFlash2 drafter's candidate-selector path there and accepts it by rejection "
        "against the selector's q (speculative/dflash_worker_v2.py), which dflash-eval does not compute; the "
        "greedy-draft tau it could give is a number no engine produces. Evaluate this drafter in a config whose "
        "datasets are greedy (temperature 0), or remove it from this run"
    )


def sampled_problems(
    config: dict[str, Any], architecture: Callable[[dict[str, Any]], str | None]
) -> list[tuple[str, str]]:
    """(key, why) for each DFlash2 drafter of a config with a sampled dataset; `architecture(spec)` reads a drafter
    entry's class (None where it cannot be read before the run)."""
    sampled = sorted(name for name, spec in config["datasets"].items() if dataset_samples(spec))
    if not sampled:
        return []
    return [
        (f"drafters.{name}", _why(name, sampled))
        for name, spec in config["drafters"].items()
        if architecture(spec) == DFLASH2
    ]


def check_sampled(drafter: str, model: Any, dataset: str, sampling: list[dict] | None) -> None:
    """The evaluate stage's own refusal (a job run by hand skips preflight): a loaded DFlash2 drafter (it has a
    candidate selector) on sampled completions."""
    if sampling is not None and getattr(model, "candidate_selector", None) is not None:
        raise DflashEvalError(_why(drafter, [dataset]))
