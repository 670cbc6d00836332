"""benchmarks/multi_gpu_scaling.py --smoke: 3 fake GPUs (real lock files and claim records), K = 1 and 2, the
demo shape on the CPU; its table says 1 and then 2 jobs at once and no overlap, and nothing is recorded."""

from __future__ import annotations

from dflash_eval.cli import main
from tests.support.benchmark_runner import BENCHMARKS, ROOT, run_in_process


# In the test process (tests/support/benchmark_runner.py), whose torch, transformers and dflash the forked jobs inherit:
# 12.6 s of CPU as its own process on the 2-core VM (2026-12-02), ~9 of them its imports. The fork is safe here
# because the test process runs torch on one thread (tests/conftest.py), so no OpenMP pool is copied into the jobs.
# The locks and the check have fast tests in tests/evaluate/test_gpu_placement.py.
def test_scaling_smoke_runs_k_jobs_at_once_without_overlap(tmp_path):
    before = sorted((ROOT / "benchmarks" / "results").iterdir())
    done = run_in_process(BENCHMARKS / "multi_gpu_scaling.py", ["--smoke", "--keep-records", str(tmp_path)])
    assert done.code == 0, done.failure()
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "jobs" not in line]
    assert [(row[0].strip(), row[1].strip(), row[5].strip(), row[6].strip()) for row in rows] == [
        ("1", "2", "1", "0"),
        ("2", "2", "2", "0"),
    ]  # K, jobs, at once, overlaps
    assert "PLACEMENT FAILED" not in done.stdout
    assert sorted((ROOT / "benchmarks" / "results").iterdir()) == before
    assert main(["gpu-placements", str(tmp_path / "K2"), "--expect-peak", "2"]) == 0  # the kept claim records
    assert main(["gpu-placements", str(tmp_path / "K1"), "--expect-peak", "1"]) == 0
