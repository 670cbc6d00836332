"""How much GPU memory is in use on this host: the check that a server told to release its memory
(SGLang's `/release_memory_occupation`) really gave it back before extraction loads a model.

Read with `server.memory_probe` when set (any shell command that prints MiB numbers, one per GPU), else
from the NVIDIA driver through NVML (nvidia-ml-py: what nvidia-smi and SGLang read too, without a CUDA
context or a subprocess per reading), else with `nvidia-smi` when it is on PATH (where nvidia-ml-py is not
installed), else with torch (which opens a CUDA context, ~0.5 GiB, on every visible GPU for the rest of the
process: set a probe or install nvidia-ml-py to avoid that). The first reader available is the only one tried; where it cannot
read, the reading says why.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

NVIDIA_SMI = "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits"
NVML = "NVML (nvidia-ml-py)"


@dataclass(frozen=True)
class Reading:
    mib: float | None  # summed over the GPUs read; None when nothing could be read
    source: str  # the command, NVML, "torch", or why nothing could be read


def used_mib(probe: str | None = None) -> Reading:
    """Used GPU memory in MiB, summed over the GPUs the probe (or NVML, nvidia-smi, torch) sees."""
    if probe:
        return _from_command(probe)
    nvml, why_not = _nvml()
    if nvml is not None:
        return _from_nvml(nvml)
    if shutil.which("nvidia-smi"):
        return _from_command(NVIDIA_SMI)
    return _from_torch(f"NVML: {why_not}; no nvidia-smi on PATH")


def _nvml() -> tuple[Any, str]:
    """pynvml, initialised (once per process; NVML counts its users), or None and why not."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:  # no driver library (a machine without NVIDIA GPUs), driver not loaded
        return None, str(error)
    return pynvml, ""


def _from_nvml(pynvml: Any) -> Reading:
    try:
        used = sum(
            pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used
            for index in range(pynvml.nvmlDeviceGetCount())
        )
    except pynvml.NVMLError as error:
        return Reading(None, f"{NVML} could not read the GPU memory: {error}")
    return Reading(used / 2**20, NVML)


def _from_command(command: str) -> Reading:
    try:
        run = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return Reading(None, f"`{command}` did not finish within 60 s")
    if run.returncode != 0:
        return Reading(None, f"`{command}` exited with {run.returncode}: {run.stderr.strip()[-300:]}")
    try:
        values = [float(line) for line in run.stdout.split()]
    except ValueError:
        return Reading(None, f"`{command}` printed {run.stdout[:200]!r}, not numbers of MiB")
    if not values:
        return Reading(None, f"`{command}` printed nothing")
    return Reading(sum(values), command)


def _from_torch(why_not_others: str) -> Reading:
    try:
        import torch
    except ImportError:
        return Reading(None, f"{why_not_others}; and no torch")
    if not torch.cuda.is_available():
        return Reading(None, f"{why_not_others}; and no CUDA device visible to torch")
    used = 0.0
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        used += (total - free) / 2**20
    return Reading(used, "torch.cuda.mem_get_info")
