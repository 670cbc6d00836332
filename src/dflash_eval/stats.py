"""Statistics over per-sample verification steps: tau in both conventions, their intervals and comparisons.

Shared by the evaluate stage (each method's tau, bootstrap CI, acceptance by position and histogram in
metrics.json) and the report (the paired difference to the reference drafter and its verdict, the server's
online tau against offline). Pure numpy on lists of steps (tokens produced per verification step, bonus included).

Every bootstrap here can resample clusters instead of samples (`clusters`: one label per sample): the n
sampled completions of one prompt share its difficulty, so they are not independent draws and resampling
them one by one understates the interval. A cluster of one sample is that sample, drawn with the same
random numbers, so intervals without clusters (greedy, n = 1) are the plain bootstrap's, to the bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def tau_stats(per_sample_steps: Sequence[Sequence[int]]) -> dict[str, float | int]:
    """Both tau conventions: z-lab (mean over samples of each sample's mean) and token-weighted."""
    used = [steps for steps in per_sample_steps if steps]
    if not used:
        return {
            "tau_mean_of_samples": float("nan"),
            "tau_token_weighted": float("nan"),
            "samples": 0,
            "steps": 0,
            "tokens": 0,
        }
    tokens = sum(sum(steps) for steps in used)
    n_steps = sum(len(steps) for steps in used)
    return {
        "tau_mean_of_samples": float(np.mean([np.mean(steps) for steps in used])),
        "tau_token_weighted": tokens / n_steps,
        "samples": len(used),
        "steps": n_steps,
        "tokens": tokens,
    }


class _Resample:
    """The bootstrap's draws of clusters: `total(x)` is, per resample, the sum of a per-sample quantity over the
    samples of the clusters drawn (with repetition). Without labels every sample is its own cluster."""

    def __init__(self, n_samples: int, n_boot: int, seed: int, clusters: Sequence[Hashable] | None = None):
        if clusters is None:
            self.groups = np.arange(n_samples)
        else:
            if len(clusters) != n_samples:
                raise ValueError(f"{len(clusters)} cluster labels for {n_samples} samples")
            first: dict[Hashable, int] = {}  # clusters numbered in order of first appearance
            self.groups = np.array([first.setdefault(label, len(first)) for label in clusters], dtype=np.int64)
        self.n_clusters = int(self.groups.max()) + 1 if n_samples else 0
        rng = np.random.default_rng(seed)
        self.picks = rng.integers(0, self.n_clusters, size=(n_boot, self.n_clusters))

    def total(self, values: np.ndarray) -> np.ndarray:
        per_cluster = np.bincount(self.groups, weights=np.asarray(values, dtype=float), minlength=self.n_clusters)
        return per_cluster[self.picks].sum(axis=1)

    def mean(self, values: np.ndarray) -> np.ndarray:
        """The mean over the drawn samples (a cluster of k samples counts k times)."""
        return self.total(values) / self.total(np.ones(len(self.groups)))


def _clusters_of_used(
    per_sample_steps: Sequence[Sequence[int]], clusters: Sequence[Hashable] | None
) -> list[Hashable] | None:
    """The labels of the samples with steps (those the statistics use), aligned with them."""
    if clusters is None:
        return None
    if len(clusters) != len(per_sample_steps):
        raise ValueError(f"{len(clusters)} cluster labels for {len(per_sample_steps)} samples")
    return [label for label, steps in zip(clusters, per_sample_steps) if steps]


def bootstrap_ci(
    per_sample_steps: Sequence[Sequence[int]],
    n_boot: int,
    seed: int,
    level: float = 0.95,
    clusters: Sequence[Hashable] | None = None,
) -> dict[str, list[float]]:
    """Percentile bootstrap over samples (or over `clusters` of them, one label per sample) for both tau conventions.

    Kept over scipy.stats.bootstrap's BCa and a delta-method ratio estimator for tokens / steps: on
    DFlash-shaped samples neither covers the token-weighted tau better (within about one point at every
    n, benchmarks/results/tau_ci_coverage.md), and keeping it keeps every recorded interval comparable.
    """
    used = [steps for steps in per_sample_steps if steps]
    means = np.array([np.mean(steps) for steps in used])
    tokens = np.array([sum(steps) for steps in used], dtype=float)
    counts = np.array([len(steps) for steps in used], dtype=float)
    return bootstrap_per_sample(
        means, tokens, counts, n_boot, seed, level, _clusters_of_used(per_sample_steps, clusters)
    )


def bootstrap_per_sample(
    means: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
    n_boot: int,
    seed: int,
    level: float = 0.95,
    clusters: Sequence[Hashable] | None = None,
) -> dict[str, list[float]]:
    """`bootstrap_ci` from per-sample tau, tokens and step counts (the rejection scheme's are expectations).

    With `clusters` the resamples draw whole clusters (the mean of samples is then over the drawn clusters'
    samples, the token-weighted tau their tokens over their steps): the cluster bootstrap."""
    if not len(means) or n_boot <= 0:
        return {"tau_mean_of_samples": [float("nan")] * 2, "tau_token_weighted": [float("nan")] * 2}
    draws = _Resample(len(means), n_boot, seed, clusters)
    boot_mean = draws.mean(means)
    boot_weighted = draws.total(tokens) / draws.total(counts)
    tail = (1 - level) / 2 * 100
    return {
        "tau_mean_of_samples": [float(np.percentile(boot_mean, tail)), float(np.percentile(boot_mean, 100 - tail))],
        "tau_token_weighted": [
            float(np.percentile(boot_weighted, tail)),
            float(np.percentile(boot_weighted, 100 - tail)),
        ],
    }


def acceptance_by_position(per_sample_steps: Sequence[Sequence[int]], block_size: int) -> list[float]:
    """Fraction of steps whose k-th draft token was accepted, k = 1..B-1 (cumulative by nature)."""
    all_steps = np.array([s for steps in per_sample_steps for s in steps])
    if all_steps.size == 0:
        return [float("nan")] * (block_size - 1)
    return [float(np.mean(all_steps - 1 >= k)) for k in range(1, block_size)]


def histogram(per_sample_steps: Sequence[Sequence[int]], block_size: int) -> dict[str, int]:
    """Count of steps producing each length 1..B (keys are strings for JSON)."""
    counts = {str(length): 0 for length in range(1, block_size + 1)}
    for steps in per_sample_steps:
        for produced in steps:
            counts[str(produced)] = counts.get(str(produced), 0) + 1
    return counts


def paired_difference(
    steps_a: dict[str, Sequence[int]],
    steps_b: dict[str, Sequence[int]],
    n_boot: int,
    seed: int,
    level: float = 0.95,
    clusters: dict[str, Hashable] | None = None,
) -> dict[str, object]:
    """tau(a) - tau(b) on the samples both evaluated, with a paired percentile bootstrap CI.

    Resampling the same sample ids for both drafters keeps the per-prompt difficulty out of the
    interval, so it is much tighter than comparing two independent CIs. Both conventions. `clusters` maps a
    sample id to its cluster (an id it does not name is its own): whole clusters are resampled.
    """
    ids = sorted(i for i in set(steps_a) & set(steps_b) if steps_a[i] and steps_b[i])
    result: dict[str, object] = {"samples": len(ids)}
    if not ids:
        for name in ("tau_mean_of_samples", "tau_token_weighted"):
            result[name] = {"difference": float("nan"), "ci95": [float("nan")] * 2}
        return result
    mean_a = np.array([np.mean(steps_a[i]) for i in ids])
    mean_b = np.array([np.mean(steps_b[i]) for i in ids])
    tok_a, n_a = (np.array([f(steps_a[i]) for i in ids], dtype=float) for f in (sum, len))
    tok_b, n_b = (np.array([f(steps_b[i]) for i in ids], dtype=float) for f in (sum, len))
    labels = None if clusters is None else [clusters.get(i, ("sample", i)) for i in ids]
    draws = _Resample(len(ids), max(n_boot, 1), seed, labels)
    tail = (1 - level) / 2 * 100
    boots = {
        "tau_mean_of_samples": (mean_a.mean() - mean_b.mean(), draws.mean(mean_a) - draws.mean(mean_b)),
        "tau_token_weighted": (
            tok_a.sum() / n_a.sum() - tok_b.sum() / n_b.sum(),
            draws.total(tok_a) / draws.total(n_a) - draws.total(tok_b) / draws.total(n_b),
        ),
    }
    for name, (difference, boot) in boots.items():
        ci = (
            [float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))]
            if n_boot > 0
            else [float("nan")] * 2
        )
        result[name] = {"difference": float(difference), "ci95": ci}
    return result


def verdict(ci95: Sequence[float]) -> str:
    """better / worse when the whole CI of a - b is above / below zero, else no clear difference."""
    low, high = ci95
    if np.isnan(low) or np.isnan(high):
        return "undetermined"
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    return "no clear difference"


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the order statistics x_(j), x_(n+1-j) with the
    largest j such that P(Binomial(n, 1/2) < j) <= (1 - level) / 2 (exact, no resampling). (-inf, inf)
    where n is too small for any j (n < 6 at 95%). Used to decide when a timed step's median is stable."""
    import math

    ordered = sorted(values)
    n = len(ordered)
    tail, below, j = (1 - level) / 2, 0.0, 0
    while j < n and below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    if j == 0:
        return float("-inf"), float("inf")
    return float(ordered[j - 1]), float(ordered[n - j])
