"""Every benchmark's `--smoke` run (issue 27): its real code path on a tiny CPU shape, its table printed, nothing
recorded under benchmarks/results/. The smokes run inside the test process (tests/support/benchmark_runner.py: torch and
transformers imported once, each run isolated), each its own test item."""

from __future__ import annotations

import pytest

from dflash_eval.speedup import validation
from tests.support.benchmark_runner import (
    BENCHMARKS,
    RESULTS,
    run_in_process,
    run_in_subprocess,
)

# script -> (a line of its table's header, runs in its own process?, marks)
SCRIPTS = {
    "argmax_speed": ("| positions | lm_head |", False, []),
    "ddtree_parts": ("| logits | anchors | part |", False, []),
    "ddtree_speed": ("| logits | budgets | before ms |", False, []),
    "dryrun_scale": ("| dry run | wall s | CPU s |", False, []),
    "score_ops": ("| pass | shape | before |", False, []),
    "startup": ("median s", False, []),
    "tau_ci_coverage": ("| tau | interval |", False, []),
    "verify_cost": ("| pass | seconds | MB/s |", False, []),
    "round_profile": ("| methods | samples | wall s |", False, []),
    "demo_build": ("| stage | seconds |", False, []),  # its smoke: 1 target step, 2 training sequences, 3 prompts
    "extract_speed": ("| backend | row | seq len |", False, []),
    "serving_profile": ("| tokens verified | run 1 ms |", False, []),
    # issue 26: the profile twice in one process and once in each of two fresh processes (3 imports: ~25 s)
    "profile_repeatability": ("| tokens verified | one process: run 1 ms |", False, []),
    "fetch_speed": ("| client | wall seconds per round |", False, []),
    "fidelity": ("| dtype | samples | equal step for step |", False, []),  # CPU, torch kernels, fp32, a tiny target
    # T > 0: the demo server (a subprocess) on a tiny target, extract + evaluate under both schemes (each in a spawned
    # process, so its own process: a spawned child re-runs the script as __main__), 4 live runs
    "fidelity_sampled": ("| dtype | served requests | offline target_only = counters per request |", True, []),
    "max_tokens_tail": ("| max_tokens | requests | cut at max_tokens |", False, []),  # tiny random target and drafter
    "checkpoints_startup": ("| code | per-checkpoint wall s, median |", False, []),
    "evaluator_speed": ("| tau | methods | evaluator |", False, []),  # issue 30's CPU forwards, the demo shape
    "speedup_validation": ("| block | tau asked | tau realised |", False, []),  # a tiny hybrid target, live loops
    # run with its placement checks (claim records, no overlap) by tests/benchmarks/test_multi_gpu_smoke.py, also in
    # this process (its forked jobs inherit the imports; safe as torch runs on one thread here, tests/conftest.py)
    "multi_gpu_scaling": ("| K | jobs | wall s |", False, [pytest.mark.skip(reason="run by test_multi_gpu_smoke.py")]),
    # (own process = True runs a script through runner.run_in_subprocess: for one that cannot share this process)
}


def results_state() -> dict[str, tuple[int, int]]:
    """benchmarks/results/ and the package's validation record (speedup_validation.py updates it): untouched."""
    paths = [*RESULTS.glob("*"), validation.RECORD]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.parametrize(
    ("name", "header", "own_process"),
    [pytest.param(name, header, own, marks=marks, id=name) for name, (header, own, marks) in SCRIPTS.items()],
)
def test_smoke(name: str, header: str, own_process: bool) -> None:
    before = results_state()
    done = (run_in_subprocess if own_process else run_in_process)(BENCHMARKS / f"{name}.py")
    assert done.code == 0, done.failure()
    assert header in done.stdout, f"benchmarks/{name}.py --smoke printed no {header!r}\n{done.failure()}"
    assert results_state() == before, f"benchmarks/{name}.py --smoke wrote under benchmarks/results/"


def test_every_benchmark_has_a_smoke_test() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - {"record"}  # record.py: the shared printer, no benchmark
    assert scripts == set(SCRIPTS), (
        f"benchmarks without a smoke entry here: {sorted(scripts - set(SCRIPTS))}; "
        f"entries without a script: {sorted(set(SCRIPTS) - scripts)}"
    )
