"""The workflow through a real SLURM with profiles/slurm: jobs go through sbatch, results equal a local run.

Needs a running cluster: `tests/support/slurm_single_node.sh start` (as root; installs Debian's slurm-wlm and
munge, starts a single-node cluster), then `python -m pytest -m slurm tests/workflow/test_slurm.py`.
The tiny project and the recording `dflash-eval` of src/dflash_eval/bench/workflow.py keep each job to
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

from dflash_eval.bench.workflow import (
    check,
    copy_workflow,
    plan,
    snakemake,
    tiny_project,
)

pytestmark = pytest.mark.slurm

# The single-node test cluster has 2 CPUs and little memory: shrink what profiles/slurm asks for.
SMALL = ["--set-resources", *(f"{rule}:{key}={value}" for rule in ("fetch", "extract", "evaluate", "report")
                              for key, value in (("cpus_per_task", 1), ("mem_mb", 300), ("runtime", 10))),
         "--default-resources", "mem_mb=300", "runtime=10", "--slurm-init-seconds-before-status-checks", "2",
         "--jobs", "4", "--latency-wait", "10"]


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

    text = check(snakemake(workflow, cluster, *SMALL, "--resources", "server_lock=2", profile="slurm",
                           timeout=1700))
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
    assert {"results/summary.csv", "results/hidden/d2/L1-2/manifest.json", "results/eval/a/d1/metrics.json"} <= set(results)
    # The SLURM run left Snakemake's metadata complete: locally, nothing is left to do.
    assert plan(workflow, cluster) == set()
