"""The best checkpoint of each training run, by the tau it would serve, and whether it is better than noise.

Training keeps the checkpoint of lowest validation loss; what a user ships is the one that accepts most. Per
training run (the drafters of one `run:`, or every drafter of known step when none names one: the tau-against-step
plot's lines) and dataset, the best step is the one of highest tau (z-lab mean) for its own chain under SGLang's
target_only verification, the method the server runs (ties: the higher token-weighted tau, then the later step).
Its paired difference to the runner-up over the samples both evaluated, with the paired bootstrap of stats.py
(clusters of a prompt's sampled draws resampled together), says whether the choice is more than noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_eval import stats
from dflash_eval.completions import prompt_cluster
from dflash_eval.methods import TARGET_ONLY
from dflash_eval.report.metrics_files import Evaluation, per_sample_steps
from dflash_eval.report.plots import training_runs


@dataclass(frozen=True)
class Best:
    """One run x dataset's best step, its runner-up and their paired difference (tau, z-lab mean)."""

    run: str
    dataset: str
    best: dict
    runner_up: dict
    difference: float
    ci95: tuple[float, float]
    samples: int

    @property
    def verdict(self) -> str:
        """The plain sentence: best, and whether the runner-up is within noise of it."""
        best, second = self.best, self.runner_up
        head = (
            f"{self.run} on {self.dataset}: step {best['training_step']} ({best['drafter']}) is best, tau "
            f"{best['tau_mean_of_samples']:.3f}"
        )
        low, high = self.ci95
        if math.isnan(low) or math.isnan(high):
            return f"{head}; its difference to step {second['training_step']} could not be paired (no common samples)"
        interval = f"paired 95% CI [{low:+.3f}, {high:+.3f}] over {self.samples} samples"
        if low > 0:
            return (
                f"{head}; it beats the runner-up, step {second['training_step']} (tau "
                f"{second['tau_mean_of_samples']:.3f}), by {self.difference:+.3f} ({interval})"
            )
        return (
            f"{head}; step {second['training_step']} (tau {second['tau_mean_of_samples']:.3f}) is within noise "
            f"of it ({self.difference:+.3f}, {interval})"
        )

    def as_dict(self) -> dict:
        return {
            "run": self.run,
            "dataset": self.dataset,
            "method": self.best["method"],
            "best": {
                "drafter": self.best["drafter"],
                "step": self.best["training_step"],
                "tau_mean_of_samples": self.best["tau_mean_of_samples"],
            },
            "runner_up": {
                "drafter": self.runner_up["drafter"],
                "step": self.runner_up["training_step"],
                "tau_mean_of_samples": self.runner_up["tau_mean_of_samples"],
            },
            "difference": self.difference,
            "ci95": list(self.ci95),
            "samples": self.samples,
            "verdict": self.verdict,
        }


def _rank(row: dict) -> tuple[float, float, int]:
    return row["tau_mean_of_samples"], row["tau_token_weighted"], int(row["training_step"])


def find(rows: list[dict], evaluations: list[Evaluation], settings: dict) -> list[Best]:
    """The best step of every run x dataset with two or more checkpoints of known tau."""
    served = [r for r in rows if r["scheme"] == TARGET_ONLY]
    by_key = {e.key: e for e in evaluations}
    found = []
    for run, members in training_runs(served, settings).items():
        for dataset in settings["datasets"]:
            points = sorted(
                (r for r in members if r["dataset"] == dataset and not math.isnan(r["tau_mean_of_samples"])),
                key=_rank,
                reverse=True,
            )
            if len(points) < 2:
                continue
            best, second = points[:2]
            mine = per_sample_steps(by_key[(best["drafter"], dataset)])[best["method"]]
            theirs = per_sample_steps(by_key[(second["drafter"], dataset)])[second["method"]]
            sampled = bool(by_key[(best["drafter"], dataset)].metrics.get("sampling"))
            clusters = {i: prompt_cluster(i, True) for i in mine} if sampled else None
            paired = stats.paired_difference(mine, theirs, settings["bootstrap"], settings["seed"], clusters=clusters)
            tau = paired["tau_mean_of_samples"]
            found.append(Best(run, dataset, best, second, tau["difference"], tuple(tau["ci95"]), paired["samples"]))
    return found


def mark(rows: list[dict], evaluations: list[Evaluation], settings: dict) -> list[Best]:
    """summary rows with the best-step columns set (the best row: its runner-up and the paired difference; the
    run's other checkpoints: best_step False); returns what it found, for the page and trust.json."""
    found = find(rows, evaluations, settings)
    for best in found:
        for row in training_runs([r for r in rows if r["scheme"] == TARGET_ONLY], settings)[best.run]:
            if row["dataset"] == best.dataset:
                row["best_step"] = row is best.best
        best.best.update(
            runner_up=best.runner_up["drafter"],
            diff_vs_runner_up=best.difference,
            runner_up_ci_low=best.ci95[0],
            runner_up_ci_high=best.ci95[1],
        )
    return found


def lines(found: list[Best]) -> list[str]:
    """summary.md's section: one verdict per run x dataset."""
    if not found:
        return []
    out = [
        "## Best checkpoint per training run",
        "",
        "Highest tau (z-lab mean, own block size, target_only verification) among each run's checkpoints, "
        "against the runner-up on the same samples (paired bootstrap); starred on tau_vs_step.png.",
        "",
    ]
    return out + [f"- {best.verdict}" for best in found] + [""]
