"""How often each 95% interval for tau covers the truth: our percentile bootstrap, BCa, a ratio estimator.

The evaluate stage reports a percentile bootstrap over samples (`evaluate.acceptance.bootstrap_ci`)
for both tau conventions. The issue asks whether `scipy.stats.bootstrap` (BCa) or a ratio estimator
(tokens / steps is a ratio of sums: its delta-method standard error) serves users better. This draws
a synthetic population of samples shaped like DFlash runs (block 16; per-sample acceptance rate from
a Beta, longer completions a little harder; lognormal completion lengths), takes `--trials` random
sets of n samples, builds each interval and counts how often it holds the population value. It
also times one interval of each kind. Prints a table and appends it to
benchmarks/results/tau_ci_coverage.md.

    python benchmarks/tau_ci_coverage.py --trials 1000
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import scipy
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)
from scipy import stats

from dflash_eval.stats import bootstrap_ci

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
Z = stats.norm.ppf(0.975)


def population(size: int, seed: int) -> list[np.ndarray]:
    """Per-sample acceptance lengths (tokens per verification step, 1..BLOCK)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(250), 0.8, size), 8, 4096).astype(int)
    hardness = (np.log(lengths) - np.log(250)) / 0.8  # longer completions accept a little less
    rate = np.clip(rng.beta(40, 8, size) - 0.02 * hardness, 0.05, 0.98)
    samples = []
    for length, p in zip(lengths, rate):
        steps = np.minimum(rng.geometric(1 - p, size=length), BLOCK)  # accepted draft + bonus token
        produced = np.cumsum(steps)
        cut = int(np.searchsorted(produced, length)) + 1
        steps = steps[:cut].copy()
        steps[-1] -= max(0, int(produced[cut - 1]) - length)  # the last step stops at the length
        samples.append(steps[steps > 0])
    return samples


def ratio_interval(tokens: np.ndarray, counts: np.ndarray) -> list[float]:
    """Ratio estimator sum(tokens) / sum(steps) with its linearized (delta-method) standard error."""
    n, ratio = len(tokens), tokens.sum() / counts.sum()
    se = np.sqrt(np.sum((tokens - ratio * counts) ** 2) / (n - 1) / n) / counts.mean()
    return [ratio - Z * se, ratio + Z * se]


def t_interval(means: np.ndarray) -> list[float]:
    n = len(means)
    half = stats.t.ppf(0.975, n - 1) * means.std(ddof=1) / np.sqrt(n)
    return [means.mean() - half, means.mean() + half]


def bca(data: tuple[np.ndarray, ...], statistic, seed: int, n_boot: int) -> list[float]:
    result = stats.bootstrap(
        data,
        statistic,
        paired=len(data) > 1,
        vectorized=True,
        n_resamples=n_boot,
        method="BCa",
        rng=np.random.default_rng(seed),
    )
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def intervals(steps: list[np.ndarray], seed: int, n_boot: int) -> dict[str, dict[str, list[float]]]:
    means = np.array([s.mean() for s in steps])
    tokens = np.array([s.sum() for s in steps], dtype=float)
    counts = np.array([len(s) for s in steps], dtype=float)
    ours = bootstrap_ci([s.tolist() for s in steps], n_boot, seed)
    return {
        "token-weighted": {
            "percentile (ours)": ours["tau_token_weighted"],
            "BCa (scipy)": bca((tokens, counts), lambda t, c, axis: t.sum(axis) / c.sum(axis), seed, n_boot),
            "ratio estimator": ratio_interval(tokens, counts),
        },
        "mean of samples": {
            "percentile (ours)": ours["tau_mean_of_samples"],
            "BCa (scipy)": bca((means,), lambda m, axis: m.mean(axis), seed, n_boot),
            "t interval": t_interval(means),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 30, 100, 300])
    parser.add_argument("--bootstrap", type=int, default=1000, help="resamples (config.yaml's default)")
    parser.add_argument("--population", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    smoke_mode(parser, trials=5, sizes=[10], bootstrap=50, population=500)
    args = parser.parse_args()
    pool = population(args.population, args.seed)
    truth = {
        "token-weighted": sum(s.sum() for s in pool) / sum(len(s) for s in pool),
        "mean of samples": float(np.mean([s.mean() for s in pool])),
    }
    rng = np.random.default_rng(args.seed + 1)
    hits: dict[tuple, int] = {}
    widths: dict[tuple, float] = {}
    for n in args.sizes:
        for trial in range(args.trials):
            chosen = [pool[i] for i in rng.choice(len(pool), n, replace=False)]
            for convention, by_method in intervals(chosen, trial, args.bootstrap).items():
                for method, (low, high) in by_method.items():
                    key = (convention, method, n)
                    hits[key] = hits.get(key, 0) + int(low <= truth[convention] <= high)
                    widths[key] = widths.get(key, 0.0) + (high - low) / args.trials
    timing = _time_each(pool[:1000], args.bootstrap)
    title = (
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.trials} trials per n, "
        f"{args.bootstrap} resamples, population {args.population} (seed {args.seed}), numpy {np.__version__}, "
        f"scipy {scipy.__version__}, {platform.processor() or platform.machine()}"
    )
    truths = (
        f"Population tau: token-weighted {truth['token-weighted']:.3f}, mean of samples "
        f"{truth['mean of samples']:.3f}. Coverage of the nominal 95% (SE about "
        f"{100 * np.sqrt(0.95 * 0.05 / args.trials):.1f} points), mean width in brackets."
    )
    lines = [
        title,
        "",
        truths,
        "",
        "| tau | interval | " + " | ".join(f"n = {n}" for n in args.sizes) + " | ms per interval (n = 1000) |",
        "|---|---|" + "---:|" * (len(args.sizes) + 1),
    ]
    for convention in ("token-weighted", "mean of samples"):
        methods = sorted({m for c, m, _ in hits if c == convention}, key=lambda m: m != "percentile (ours)")
        for method in methods:
            cells = [
                f"{100 * hits[(convention, method, n)] / args.trials:.1f}% ({widths[(convention, method, n)]:.3f})"
                for n in args.sizes
            ]
            lines.append(f"| {convention} | {method} | " + " | ".join(cells) + f" | {timing[method]:.1f} |")
    print_and_record(lines, None if args.smoke else ROOT / "benchmarks" / "results" / "tau_ci_coverage.md")


def _time_each(steps: list[np.ndarray], n_boot: int) -> dict[str, float]:
    """Milliseconds per interval on 1000 samples, each kind on its own (the bootstrap both conventions)."""
    means = np.array([s.mean() for s in steps])
    tokens = np.array([s.sum() for s in steps], dtype=float)
    counts = np.array([len(s) for s in steps], dtype=float)
    lists = [s.tolist() for s in steps]
    runs = {
        "percentile (ours)": lambda: bootstrap_ci(lists, n_boot, 0),
        "BCa (scipy)": lambda: bca((tokens, counts), lambda t, c, axis: t.sum(axis) / c.sum(axis), 0, n_boot),
        "ratio estimator": lambda: ratio_interval(tokens, counts),
        "t interval": lambda: t_interval(means),
    }
    result = {}
    for name, run in runs.items():
        started = time.perf_counter()
        for _ in range(5):
            run()
        result[name] = (time.perf_counter() - started) / 5 * 1000
    return result


if __name__ == "__main__":
    main()
