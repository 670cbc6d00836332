"""The cluster bootstrap (stats): the n sampled completions of one prompt are resampled together.

Against independent references: a plain percentile bootstrap written out here (the formula the project used
before clusters existed), and a hand-made case where the answer is known: when every prompt's draws are
identical, resampling prompts is resampling the prompts' own values, so the cluster interval equals the plain
bootstrap of the per-prompt values, while resampling draws one by one shrinks it by about sqrt(n).
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_eval import stats
from dflash_eval.completions import prompt_cluster


def plain_percentile(means: np.ndarray, tokens: np.ndarray, counts: np.ndarray, n_boot: int, seed: int):
    """Resample samples, independently of stats' code."""
    picks = np.random.default_rng(seed).integers(0, len(means), size=(n_boot, len(means)))
    mean = means[picks].mean(axis=1)
    weighted = tokens[picks].sum(axis=1) / counts[picks].sum(axis=1)
    return {
        "tau_mean_of_samples": [float(np.percentile(mean, 2.5)), float(np.percentile(mean, 97.5))],
        "tau_token_weighted": [float(np.percentile(weighted, 2.5)), float(np.percentile(weighted, 97.5))],
    }


def _steps(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 9, size=rng.integers(1, 12)).tolist() for _ in range(n)]


def _arrays(steps):
    return (
        np.array([np.mean(s) for s in steps]),
        np.array([sum(s) for s in steps], dtype=float),
        np.array([len(s) for s in steps], dtype=float),
    )


@pytest.mark.parametrize("n", [1, 5, 59])
def test_clusters_of_one_are_the_plain_bootstrap_to_the_bit(n):
    """n = 1 (every draw its own prompt) and greedy (no labels) give the plain bootstrap's numbers exactly."""
    steps = _steps(n, n)
    reference = plain_percentile(*_arrays(steps), 400, 7)
    assert stats.bootstrap_ci(steps, 400, 7) == reference
    assert stats.bootstrap_ci(steps, 400, 7, clusters=[f"p{i}#s0" for i in range(n)]) == reference
    a = {f"p{i}": s for i, s in enumerate(steps)}
    b = {f"p{i}": s[::-1][:3] for i, s in enumerate(steps)}
    assert stats.paired_difference(a, b, 300, 1, clusters={i: i for i in a}) == stats.paired_difference(a, b, 300, 1)


def test_identical_draws_of_a_prompt_widen_the_interval_to_the_prompts_own():
    """10 prompts x 4 identical draws: the cluster CI is the plain CI of the 10 prompts (same random draws);
    resampling the 40 draws as if independent gives an interval about half as wide."""
    prompts = _steps(3, 10)
    draws = [s for s in prompts for _ in range(4)]
    labels = [f"p{i}" for i in range(10) for _ in range(4)]
    clustered = stats.bootstrap_ci(draws, 2000, 0, clusters=labels)
    by_prompt = plain_percentile(*_arrays(prompts), 2000, 0)
    for name in clustered:
        assert clustered[name] == pytest.approx(by_prompt[name], rel=1e-12)
    naive = stats.bootstrap_ci(draws, 2000, 0)
    width = {k: v[1] - v[0] for k, v in clustered.items()}
    naive_width = {k: v[1] - v[0] for k, v in naive.items()}
    for name in width:
        assert width[name] > 1.6 * naive_width[name], (name, width[name], naive_width[name])


def test_clusters_follow_the_samples_with_steps_and_the_paired_draws():
    """Samples without steps are dropped with their labels; a paired difference resamples whole prompts."""
    prompts = _steps(4, 8)
    draws = [s for s in prompts for _ in range(3)] + [[]]
    labels = [f"p{i}" for i in range(8) for _ in range(3)] + ["empty"]
    assert stats.bootstrap_ci(draws, 500, 2, clusters=labels) == stats.bootstrap_ci(
        draws[:-1], 500, 2, clusters=labels[:-1]
    )
    with pytest.raises(ValueError, match="cluster labels"):
        stats.bootstrap_ci(draws, 10, 0, clusters=labels[:-2])
    a = {f"p{i}#s{k}": prompts[i] for i in range(8) for k in range(3)}
    b = {key: [1] * len(steps) for key, steps in a.items()}  # tau(b) = 1 everywhere
    clustered = stats.paired_difference(a, b, 2000, 0, clusters={i: prompt_cluster(i, True) for i in a})
    by_prompt = stats.paired_difference(
        {f"p{i}": prompts[i] for i in range(8)}, {f"p{i}": [1] * len(prompts[i]) for i in range(8)}, 2000, 0
    )
    for name in ("tau_mean_of_samples", "tau_token_weighted"):
        assert clustered[name]["difference"] == pytest.approx(by_prompt[name]["difference"], rel=1e-12)
        assert clustered[name]["ci95"] == pytest.approx(by_prompt[name]["ci95"], rel=1e-12)


def test_prompt_cluster_strips_only_a_sampled_draw_suffix():
    assert prompt_cluster("q7#s3", True) == "q7" and prompt_cluster("mt#2#s11", True) == "mt#2"
    assert prompt_cluster("q7#s3", False) == "q7#s3" and prompt_cluster("q7", True) == "q7"
