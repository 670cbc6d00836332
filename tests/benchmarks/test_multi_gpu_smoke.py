"""benchmarks/multi_gpu_scaling.py --smoke: 3 fake GPUs (real lock files and claim records), K = 1 and 2, the
demo shape on the CPU; its table says 1 and then 2 jobs at once and no overlap, and nothing is recorded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_eval.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ~55 s on the loaded 2-core dev machine (2026-12-02), nearly all of it importing torch, transformers and dflash
# once; the two K rows take 2 s each. The locks and the check have fast tests in tests/evaluate/test_gpu_placement.py.
def test_scaling_smoke_runs_k_jobs_at_once_without_overlap(tmp_path):
    before = sorted((ROOT / "benchmarks" / "results").iterdir())
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu_scaling.py"), "--smoke",
                           "--keep-records", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "jobs" not in line]
    assert [(row[0].strip(), row[1].strip(), row[5].strip(), row[6].strip()) for row in rows] == [
        ("1", "2", "1", "0"), ("2", "2", "2", "0")]  # K, jobs, at once, overlaps
    assert "PLACEMENT FAILED" not in done.stdout
    assert sorted((ROOT / "benchmarks" / "results").iterdir()) == before
    assert main(["gpu-placements", str(tmp_path / "K2"), "--expect-peak", "2"]) == 0  # the kept claim records
    assert main(["gpu-placements", str(tmp_path / "K1"), "--expect-peak", "1"]) == 0
