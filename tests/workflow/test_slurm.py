"""The workflow through a real SLURM with profiles/slurm: jobs go through sbatch, results equal a local run.

Needs a running cluster: `tests/support/slurm_single_node.sh start` (as root; installs Debian's slurm-wlm and
munge, starts a single-node cluster), then `python -m pytest -m slurm tests/workflow/test_slurm.py`.
The tiny project and the recording `dflash-eval` of src/dflash_eval/testing/workflow.py keep each job to
seconds: what is tested is the submission path (profile, resources, status polling, the Snakemake
job step on the node), not the stages, which other tests cover.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from dflash_eval.evaluate import placement
from dflash_eval.testing.workflow import check, plan, snakemake, tiny_project
from tests.support.checkout import copy_workflow, copy_workflow_with_stand_in

pytestmark = pytest.mark.slurm

# The single-node test cluster has 2 CPUs and little memory: shrink what profiles/slurm asks for.
SMALL = [
    "--set-resources",
    *(
        f"{rule}:{key}={value}"
        for rule in ("fetch", "extract", "evaluate", "report")
        for key, value in (("cpus_per_task", 1), ("mem_mb", 300), ("runtime", 10))
    ),
    "--default-resources",
    "mem_mb=300",
    "runtime=10",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--jobs",
    "4",
    "--latency-wait",
    "10",
]


def _cluster_up() -> bool:
    if not shutil.which("sbatch"):
        return False
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return state.returncode == 0 and any(s.startswith(("idle", "mixed", "alloc")) for s in state.stdout.split())


def _results(root: Path) -> dict[str, str]:
    """Every result file but logs and benchmarks (timings), by relative path."""
    files = {}
    for path in sorted((root / "results").rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and not relative.startswith(("results/logs/", "results/benchmarks/")):
            files[relative] = path.read_text()
    return files


# Each SLURM job starts Snakemake twice (batch script, then its srun job step): one to two minutes per
# job on a loaded 2-core machine. So the project is one drafter on two datasets (7 jobs, 4 rounds), and
# server_lock is raised to 2 so that the two fetches and the two extractions run side by side.
JOBS = {"fetch": 2, "extract": 2, "evaluate": 2, "report": 1}


@pytest.mark.timeout(1800)
def test_tiny_workflow_through_slurm_equals_a_local_run(tmp_path):
    if not _cluster_up():
        pytest.fail("no SLURM cluster answers: start one with `tests/support/slurm_single_node.sh start` (as root)")
    workflow = copy_workflow(tmp_path / "workflow")
    local, cluster = tmp_path / "local", tmp_path / "cluster"
    tiny_project(local, drafters=1)
    tiny_project(cluster, drafters=1)
    check(snakemake(workflow, local))

    text = check(snakemake(workflow, cluster, *SMALL, "--resources", "server_lock=2", profile="slurm", timeout=1700))
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", text)
    assert len(submitted) == sum(JOBS.values()), text[-4000:]
    logs = {p.stem: p for p in (cluster / "results" / "logs" / "slurm").rglob("*.log")}
    assert set(submitted) <= set(logs), f"SLURM log files {sorted(logs)} lack job ids {submitted}"
    for job_id in submitted:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        assert "JobState=COMPLETED" in shown, shown
        assert "--executor slurm-jobstep" in logs[job_id].read_text(), "the job ran Snakemake's job step"
    calls = (cluster / "calls.log").read_text().splitlines()
    assert Counter(call.split()[0] for call in calls) == JOBS
    assert sorted(calls) == sorted((local / "calls.log").read_text().splitlines())
    packages = set((cluster / "packages.log").read_text().split())
    assert packages == {str(workflow / "src" / "dflash_eval" / "__init__.py")}, "jobs saw the submitter's PYTHONPATH"
    results = _results(cluster)
    assert results == _results(local)
    assert {"results/summary.csv", "results/hidden/d2/L1-2/manifest.json", "results/eval/a/d1/metrics.json"} <= set(
        results
    )
    # The SLURM run left Snakemake's metadata complete: locally, nothing is left to do.
    assert plan(workflow, cluster) == set()


# The evaluate jobs' dflash-eval for the GPU test: the GPU SLURM gave the job (CUDA_VISIBLE_DEVICES, one index on the
# test cluster's fake GRES) is its identity, as a UUID is on real GPUs; it is claimed through the real lock code with
# a claim record, held a while so that the two evaluations overlap, and the recorder writes the outputs.
GPU_STAND_IN = r"""#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "evaluate":
    from dflash_eval.evaluate.gpu import claim_gpu
    visible = os.environ["CUDA_VISIBLE_DEVICES"]  # unset: SLURM gave no GPU, and the job fails here
    record = rest[rest.index("--placement") + 1]
    claim_gpu(None, "cuda", [f"GPU-fake{{visible}}"], poll_s=0.1, record=record, job=record)
    time.sleep(30)
sys.exit(subprocess.run([os.path.join(os.path.dirname(sys.argv[0]), "recorder"), *args]).returncode)
"""


def _fake_gpus() -> int:
    shown = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True).stdout
    found = re.search(r"Gres=gpu:(\d+)", shown)
    return int(found.group(1)) if found else 0


@pytest.mark.timeout(1800)
def test_gpu_jobs_request_a_gpu_each_and_cpu_jobs_none(tmp_path):
    """profiles/slurm on the test cluster's fake GRES: each evaluation asks for one GPU (the rule's `gpu`
    resource, which the plugin turns into --gpus=1), gets its own (CUDA_VISIBLE_DEVICES), and no other job asks."""
    if not _cluster_up():
        pytest.fail("no SLURM cluster answers: start one with `tests/support/slurm_single_node.sh start` (as root)")
    if _fake_gpus() < 2:
        pytest.fail("the test cluster has fewer than 2 GPUs: restart it with tests/support/slurm_single_node.sh start")
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", GPU_STAND_IN)
    root = tmp_path / "cluster"
    tiny_project(root, drafters=2, datasets=1, big_checkpoint=False)
    # evaluation.device cuda is refused at load by a CPU-only torch: the GPU count comes from --set-resources
    # (one --set-resources list: a second flag would replace SMALL's)
    small = [*SMALL[:1], "evaluate:gpu=1", *SMALL[1:]]
    text = check(snakemake(workflow, root, *small, profile="slurm", timeout=1700))
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", text)
    logs = {
        p.stem: p.relative_to(root / "results" / "logs" / "slurm").parts[0].removeprefix("rule_")
        for p in (root / "results" / "logs" / "slurm").rglob("*.log")
    }
    asked = {}
    for job_id in submitted:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        assert "JobState=COMPLETED" in shown, shown
        asked[job_id] = re.findall(r"TresPerJob=(\S+)", shown)
    by_rule = Counter((logs[job_id], tuple(asked[job_id])) for job_id in submitted)
    assert by_rule == {("fetch", ()): 1, ("extract", ()): 1, ("evaluate", ("gres:gpu:1",)): 2, ("report", ()): 1}
    records = placement.read_records([root / "results" / "benchmarks" / "evaluate"])
    result = placement.check_placements(records)
    assert result.ok and result.peak == 2, result
    assert sorted(r["cuda_visible_devices"] for r in records) == ["0", "1"]  # each its own GPU
    assert {r["slurm_job_id"] for r in records} <= set(submitted)
