"""Every benchmark's `--smoke` run (issue 27): its real code path on a tiny CPU shape, its table printed, nothing
recorded under benchmarks/results/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLOW = pytest.mark.slow

# script -> a line of its table's header (or a marked param: too slow for the default run on 2 CPU cores)
SCRIPTS = {
    "argmax_speed": ("| positions | lm_head |", []),
    "ddtree_parts": ("| logits | anchors | part |", []),
    "ddtree_speed": ("| logits | budgets | before ms |", []),
    "dryrun_scale": ("| dry run | wall s | CPU s |", []),
    "score_ops": ("| pass | shape | before |", []),
    "startup": ("median s", []),
    "tau_ci_coverage": ("| tau | interval |", []),
    "verify_cost": ("| pass | seconds | MB/s |", []),
    "round_profile": ("| methods | samples | wall s |", []),
    "demo_build": ("| stage | seconds |", []),  # its smoke: 1 target step, 2 training sequences, 3 prompts
    "extract_speed": ("| backend | row | seq len |", []),
    "serving_profile": ("| tokens verified | run 1 ms |", []),
    # issue 26: the profile twice in one process and once in each of two fresh processes (3 imports: ~25 s)
    "profile_repeatability": ("| tokens verified | one process: run 1 ms |", []),
    "fetch_speed": ("| client | wall seconds per round |", []),
    "fidelity": ("| dtype | samples | equal step for step |", []),  # CPU, torch kernels, fp32, a tiny target
    "max_tokens_tail": ("| max_tokens | requests | cut at max_tokens |", []),  # tiny random target and drafter
    "checkpoints_startup": ("| code | per-checkpoint wall s, median |", []),
    # issue 30's benchmark: CPU forwards of the trajectory evaluator on the demo shape, about a minute on 2 cores
    "evaluator_speed": ("| tau | methods | evaluator |", []),
    # builds a tiny hybrid target and drafter and runs the live loops (half a minute on 2 shared cores, imports included)
    "speedup_validation": ("| block | tau asked | tau realised |", []),
    # run with its placement checks (claim records, no overlap) by tests/benchmarks/test_multi_gpu_smoke.py
    "multi_gpu_scaling": ("| K | jobs | wall s |", [pytest.mark.skip(reason="run by test_multi_gpu_smoke.py")]),
}


def results_state() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (ROOT / "benchmarks" / "results").glob("*")}


@pytest.mark.parametrize(("name", "header"), [pytest.param(name, header, marks=marks, id=name)
                                             for name, (header, marks) in SCRIPTS.items()])
def test_smoke(name: str, header: str) -> None:
    # OMP_NUM_THREADS=1: with several processes on 2 cores, torch's OpenMP threads spin-wait; extract_speed's smoke
    # took 117 s of CPU with the default threads and 21 s with one, on the same loaded machine (its table the same)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    before = results_state()
    done = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert header in done.stdout
    assert results_state() == before, "a smoke run appended to benchmarks/results/"


def test_every_benchmark_has_a_smoke_test() -> None:
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"record"}
    assert scripts == set(SCRIPTS)
