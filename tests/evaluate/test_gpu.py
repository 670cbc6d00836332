"""GPU assignment without a GPU: the device list is injected, the locks are real files and processes."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import gpu

GPUS = ["GPU-a", "GPU-b", "GPU-c"]


@pytest.fixture(autouse=True)
def _release():
    yield
    while gpu._held:  # drop every GPU this process claimed (the end of the process does the same)
        gpu._held.pop().close()


def _hold_in_subprocess(directory, name):
    """Another process holding one GPU's lock until its stdin closes."""
    code = (
        "import fcntl, sys; h = open(sys.argv[1], 'a+'); fcntl.flock(h, fcntl.LOCK_EX); print('held', flush=True);"
        " sys.stdin.read()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(directory / f"{name}.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "held"
    return process


def test_cpu_needs_no_lock(tmp_path):
    assert gpu.claim_device("cpu", GPUS, tmp_path) == torch.device("cpu")
    assert list(tmp_path.iterdir()) == []


def test_each_evaluation_takes_a_gpu_no_other_holds(tmp_path):
    other = _hold_in_subprocess(tmp_path, "GPU-a")
    try:
        assert gpu.claim_device("cuda", GPUS, tmp_path) == torch.device("cuda", 1)
        assert gpu.claim_device("cuda", GPUS, tmp_path) == torch.device("cuda", 2)
    finally:
        other.stdin.close()
        other.wait()
    assert gpu.claim_device("cuda", GPUS, tmp_path) == torch.device("cuda", 0)  # freed by the process's end


def test_a_lock_dies_with_its_process(tmp_path):
    other = _hold_in_subprocess(tmp_path, "GPU-b")
    other.kill()
    other.wait()
    assert gpu.claim_device("cuda:1", GPUS, tmp_path) == torch.device("cuda", 1)


def test_when_all_are_held_the_next_waits_for_one_to_free(tmp_path):
    others = [_hold_in_subprocess(tmp_path, name) for name in GPUS]  # other evaluations, one per GPU
    try:
        got = []
        waiter = threading.Thread(target=lambda: got.append(gpu.claim_device("cuda", GPUS, tmp_path, poll_s=0.05)))
        waiter.start()
        time.sleep(0.3)
        assert not got, "claimed a GPU that another evaluation holds"
        others[1].stdin.close()  # the evaluation on cuda:1 ends
        others[1].wait()
        waiter.join(timeout=5)
        assert got == [torch.device("cuda", 1)]
    finally:
        for other in others:
            if other.poll() is None:
                other.stdin.close()
                other.wait()


def test_an_explicit_index_waits_for_that_gpu(tmp_path):
    other = _hold_in_subprocess(tmp_path, "GPU-a")
    try:
        with pytest.raises(DflashEvalError, match="no free GPU for 'cuda:0'"):
            gpu.claim_device("cuda:0", GPUS, tmp_path, poll_s=0.05, timeout_s=0.2)
        assert gpu.claim_device("cuda", GPUS, tmp_path) == torch.device("cuda", 1)
    finally:
        other.stdin.close()
        other.wait()


def test_no_visible_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(DflashEvalError, match="no CUDA device is visible; set evaluation.device: cpu"):
        gpu.claim_device("cuda", [], tmp_path)
    with pytest.raises(DflashEvalError, match="only 3 CUDA device"):
        gpu.claim_device("cuda:5", GPUS, tmp_path)


def test_a_cpu_evaluation_records_its_device_and_no_gpu(tmp_path):
    """The workflow always passes --placement: a CPU evaluation's record says cpu, so the check counts it apart."""
    import json

    assert gpu.claim_device(
        "cpu", GPUS, tmp_path / "locks", record=tmp_path / "r.gpu.json", job="evaluate a d1"
    ) == torch.device("cpu")
    record = json.loads((tmp_path / "r.gpu.json").read_text())
    assert (record["device"], record["job"], record["start"]) == ("cpu", "evaluate a d1", record["end"])
    assert "gpu" not in record and not (tmp_path / "locks").exists()


def test_a_second_evaluation_in_one_process_takes_its_own_gpu_again_without_waiting(tmp_path):
    """Two evaluations in one process (evaluate.several, a benchmark's two dtypes) on a one-GPU machine: the second
    claim must not wait for the lock the first one holds (it waited forever on an H200)."""
    one = ["GPU-a"]
    assert gpu.claim_device("cuda:0", one, tmp_path, timeout_s=0.5) == torch.device("cuda", 0)
    assert gpu.claim_device("cuda:0", one, tmp_path, timeout_s=0.5) == torch.device("cuda", 0)
    assert gpu.claim_device("cuda", one, tmp_path, timeout_s=0.5) == torch.device("cuda", 0)
    assert len(gpu._held) == 1  # the one lock, not a second handle


def test_a_process_takes_a_free_gpu_before_reusing_its_own(tmp_path):
    assert gpu.claim_device("cuda", GPUS[:2], tmp_path, timeout_s=0.5) == torch.device("cuda", 0)
    assert gpu.claim_device("cuda", GPUS[:2], tmp_path, timeout_s=0.5) == torch.device("cuda", 1)
    assert gpu.claim_device("cuda", GPUS[:2], tmp_path, timeout_s=0.5) == torch.device("cuda", 0)
