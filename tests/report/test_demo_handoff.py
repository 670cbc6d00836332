"""What the demo hands on: its speculation profiles against its own samples.csv, its best drafter step with a
paired interval, and records that re-read and check against the run's outputs. Needs the demo run
(`snakemake --cores 2`), so it is marked slow."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from dflash_eval.report import export

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"

pytestmark = pytest.mark.slow


def evaluations() -> list[Path]:
    found = sorted(RESULTS.glob("eval/*/*/metrics.json"))
    if not (RESULTS / "summary.csv").exists() or not found:
        pytest.skip("run the demo first: snakemake --cores 2")
    return [path.parent for path in found]


def counted_rates(path: Path) -> dict[str, tuple[list[float], list[float | None], int]]:
    """method -> (marginal, conditional, steps), counted from samples.csv's acceptance lengths, row by row."""
    lengths: dict[str, list[int]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            lengths.setdefault(row["method"], []).extend(int(x) for x in row["acceptance_lengths"].split())
    out = {}
    for method, steps in lengths.items():
        depth = max(steps)  # checked below against the profile's K
        marginal = [sum(n > k for n in steps) / len(steps) for k in range(1, depth)]
        conditional = [
            sum(n > k for n in steps) / r if (r := sum(n >= k for n in steps)) else None for k in range(1, depth)
        ]
        out[method] = (marginal, conditional, len(steps))
    return out


def test_every_profile_agrees_with_its_samples_csv():
    for directory in evaluations():
        profile = json.loads((directory / "speculation_profile.json").read_text())
        counted = counted_rates(directory / "samples.csv")
        assert set(profile["profiles"]) == set(counted)
        for method, numbers in profile["profiles"].items():
            marginal, conditional, steps = counted[method]
            k = numbers["num_speculative_tokens"]
            assert numbers["num_steps"] == steps
            assert numbers["marginal_accept_rates"][: len(marginal)] == pytest.approx(marginal, abs=1e-12)
            assert all(m == 0 for m in numbers["marginal_accept_rates"][len(marginal) : k])  # lengths never reached
            assert numbers["conditional_accept_rates"][: len(conditional)] == pytest.approx(conditional, abs=1e-12)
            assert numbers["validation"]["mean_consistency"]["passed"], (directory, method)
            assert sum(b["num_steps"] for b in numbers["by_context_length"]) == steps


def test_the_demo_names_its_best_step_with_a_paired_interval():
    evaluations()
    frame = pd.read_csv(RESULTS / "summary.csv")
    best = frame[frame["best_step"] == True]  # noqa: E712 (a CSV cell)
    assert len(best) == frame["dataset"].nunique()  # the demo's one run of steps, on each dataset
    assert best["diff_vs_runner_up"].notna().all() and (best["runner_up_ci_low"] <= best["runner_up_ci_high"]).all()
    assert all(Path(REPO / p).is_file() for p in frame["speculation_profile"].dropna())
    text = (RESULTS / "summary.md").read_text().split("## Best checkpoint per training run", 1)[1]
    for row in best.itertuples():
        assert f"on {row.dataset}: step {row.training_step} ({row.drafter}) is best" in text
    assert "paired 95% CI" in text


def test_every_record_rereads_and_checks_against_the_runs_outputs(monkeypatch):
    monkeypatch.chdir(REPO)  # a record names its files as the workflow did: relative to the project directory
    for directory in evaluations():
        record = directory / "record.json"
        assert export.check_record(record) == [], record
        kept = json.loads(record.read_text())
        metrics = json.loads((directory / "metrics.json").read_text())
        assert kept["numbers"]["target_only"].keys() == metrics["methods"].keys()
        assert kept["versions"]["extraction"]["versions"]["torch"]
        assert kept["inputs"]["checkpoint"]["sha256"] == metrics["checkpoint"]["sha256"]
