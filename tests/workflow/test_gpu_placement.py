"""`snakemake --resources gpu=K` with the real Snakefile: K evaluations at once, each on its own GPU.

No GPU here: the evaluate jobs' `dflash-eval` is a stand-in that claims one of the injected fake GPUs through the
real lock code (`evaluate.gpu.claim_gpu`), writes the claim record the rule names (`--placement`), holds the GPU a
moment as an evaluation would, then hands over to the recorder for the outputs. The evaluations get `gpu=1` from
`--set-resources` (their rule gives 1 only for evaluation.device cuda, which a CPU-only torch refuses at load).
What is checked is what a K-GPU node must show: no two jobs at once on one GPU, and K running side by side.
"""

from __future__ import annotations

import pytest

from dflash_eval.evaluate import placement
from dflash_eval.testing.workflow import check, snakemake, tiny_project
from tests.support.checkout import copy_workflow_with_stand_in

STAND_IN = r"""#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "evaluate":
    from dflash_eval.evaluate.gpu import claim_gpu
    record = rest[rest.index("--placement") + 1]
    claim_gpu(None, "cuda", os.environ["FAKE_GPUS"].split(","), poll_s=0.02, record=record, job=record)
    time.sleep(float(os.environ["HOLD_S"]))
code = subprocess.run([os.path.join(os.path.dirname(sys.argv[0]), "recorder"), *args]).returncode
sys.exit(code)
"""

DRAFTERS = 4

# One real snakemake run of 8 jobs: 28 s on the loaded 2-core dev machine (2026-12-02), over the 20 s of the
# default suite; tests/evaluate/test_gpu_placement.py covers the locks and the check with real processes in seconds.
pytestmark = pytest.mark.slow


def test_k_evaluations_at_once_each_on_its_own_gpu(tmp_path, fake_gpus=3, k=2):
    """3 GPUs, `--resources gpu=2`: Snakemake caps the count, the locks pick the GPU (25 s on the loaded 2-core VM)."""
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", STAND_IN)
    root = tmp_path / "project"
    tiny_project(root, drafters=DRAFTERS, datasets=1, big_checkpoint=False)
    gpus = ",".join(f"GPU-fake{i}" for i in range(fake_gpus))
    check(
        snakemake(
            workflow,
            root,
            "--cores",
            "8",
            "--resources",
            f"gpu={k}",
            "server_lock=1",
            "--set-resources",
            "evaluate:gpu=1",
            "--set-threads",
            "evaluate=1",
            env={"FAKE_GPUS": gpus, "HOLD_S": "1.0", "DFLASH_EVAL_GPU_LOCKS": str(tmp_path / "locks")},
        )
    )
    records = placement.read_records([root / "results" / "benchmarks" / "evaluate"])
    assert len(records) == DRAFTERS
    result = placement.check_placements(records)
    assert result.ok, result
    assert result.peak == k, f"{result.peak} evaluations ran at once with --resources gpu={k}"
    assert sum(result.jobs_per_gpu.values()) == DRAFTERS and len(result.jobs_per_gpu) >= k
    assert sorted(r["job"] for r in records) == [
        f"results/benchmarks/evaluate/{name}/d1.gpu.json" for name in ("a", "b", "x2", "x3")
    ]
