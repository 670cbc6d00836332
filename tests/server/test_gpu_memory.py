"""gpu_memory.used_mib: which reader is used (probe, NVML, nvidia-smi, torch) and what each reports. NVML is
replaced by a stand-in module here (no GPU on the dev machine); the gpu-marked test compares the real one
with nvidia-smi."""

from __future__ import annotations

import os
import shutil
import sys
import types

import pytest
import torch

from dflash_eval.server import gpu_memory

MIB = 2**20


def fake_nvml(used_bytes: list[int], init_error: str | None = None, query_error: str | None = None):
    """A stand-in for pynvml: `used_bytes` per GPU; nvmlInit or the memory query can fail."""

    class NVMLError(Exception):
        pass

    def init() -> None:
        if init_error:
            raise NVMLError(init_error)

    def memory(handle: int):
        if query_error:
            raise NVMLError(query_error)
        return types.SimpleNamespace(used=used_bytes[handle], total=80 * 1024 * MIB)

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: len(used_bytes),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetMemoryInfo=memory,
    )


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH that prints two GPUs' used MiB, as the real one does for NVIDIA_SMI's query."""
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\nprintf '100\\n250\\n'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    return script


def test_nvml_is_read_first_and_summed_over_gpus(monkeypatch, fake_nvidia_smi):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([3000 * MIB, 512 * MIB]))
    assert gpu_memory.used_mib() == gpu_memory.Reading(3512.0, gpu_memory.NVML)


def test_a_probe_wins_over_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([3000 * MIB]))
    assert gpu_memory.used_mib("echo 7; echo 8") == gpu_memory.Reading(15.0, "echo 7; echo 8")


def test_without_a_driver_library_nvidia_smi_is_read(monkeypatch, fake_nvidia_smi):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([], init_error="NVML Shared Library Not Found"))
    assert gpu_memory.used_mib() == gpu_memory.Reading(350.0, gpu_memory.NVIDIA_SMI)


def test_without_nvidia_ml_py_nvidia_smi_is_read(monkeypatch, fake_nvidia_smi):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert gpu_memory.used_mib() == gpu_memory.Reading(350.0, gpu_memory.NVIDIA_SMI)


def test_an_nvml_that_cannot_read_says_so_and_tries_nothing_else(monkeypatch, fake_nvidia_smi):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([1], query_error="GPU is lost"))
    reading = gpu_memory.used_mib()
    assert reading.mib is None and "NVML (nvidia-ml-py) could not read the GPU memory: GPU is lost" in reading.source


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or torch.cuda.is_available(), reason="this machine can read its GPU memory"
)
def test_on_a_machine_without_gpus_the_reading_says_why_for_each_reader():
    reading = gpu_memory.used_mib()
    assert reading.mib is None
    assert reading.source.startswith("NVML: ") and "no nvidia-smi on PATH" in reading.source
    assert "no CUDA device visible to torch" in reading.source


@pytest.mark.gpu
def test_nvml_sees_an_allocation_as_nvidia_smi_does():
    """What the release check needs: a 4 GiB block shows as 4 GiB more in use through NVML, as through nvidia-smi
    (the two differ by a constant where one counts the driver's reserved memory and the other does not)."""
    assert shutil.which("nvidia-smi"), "the GPU machine has nvidia-smi"
    torch.zeros(1, device="cuda")  # the CUDA context first, so that only the block is measured
    before = gpu_memory.used_mib(), gpu_memory.used_mib(gpu_memory.NVIDIA_SMI)
    block = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after = gpu_memory.used_mib(), gpu_memory.used_mib(gpu_memory.NVIDIA_SMI)
    del block
    torch.cuda.empty_cache()
    assert before[0].source == gpu_memory.NVML
    for start, end in zip(before, after):
        assert abs(end.mib - start.mib - 4096) <= 64, (before, after)
