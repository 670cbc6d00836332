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
    # about a minute on 2 shared cores even on the demo shape (CPU forwards of the trajectory evaluator)
    "evaluator_speed": ("| tau | methods | evaluator |", SLOW),
    "round_profile": ("| methods | samples | wall s |", SLOW),
    # builds the smallest demo: the drafters' step generates the demo prompts' completions (minutes on CPU)
    "demo_build": ("| stage | seconds |", SLOW),
    "extract_speed": ("| backend | row | seq len |", SLOW),
    "serving_profile": ("| tokens verified | run 1 ms |", SLOW),
    # builds a tiny hybrid target and drafter and runs the live loops (half a minute on 2 shared cores, imports included)
    "speedup_validation": ("| block | tau asked | tau realised |", SLOW),
    # its --smoke fails an assertion of the fetch stage (records != requests): not fixed yet
    "fetch_speed": ("| client | wall seconds per round |", [SLOW, pytest.mark.xfail(reason="smoke mode fails", strict=False)]),
    # no smoke mode yet: needs a served target's completions and HF checkpoints
    "fidelity": ("", [SLOW, pytest.mark.xfail(reason="no --smoke yet (issue 27)", strict=False)]),
}


def results_state() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (ROOT / "benchmarks" / "results").glob("*")}


@pytest.mark.parametrize(("name", "header"), [pytest.param(name, header, marks=marks, id=name)
                                             for name, (header, marks) in SCRIPTS.items()])
def test_smoke(name: str, header: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    before = results_state()
    done = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert header in done.stdout
    assert results_state() == before, "a smoke run appended to benchmarks/results/"


def test_every_benchmark_has_a_smoke_test() -> None:
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"record"}
    assert scripts == set(SCRIPTS)
