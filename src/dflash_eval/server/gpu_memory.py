"""How much GPU memory is in use on this host: the check that a server told to release its memory
(SGLang's `/release_memory_occupation`) really gave it back before extraction loads a model.

Read with `server.memory_probe` when set (any shell command that prints MiB numbers, one per GPU),
else with `nvidia-smi` when it is on PATH, else with torch (which opens a CUDA context, ~0.5 GiB, on
every visible GPU for the rest of the process: set a probe or install nvidia-smi to avoid that).
The chosen reader is the only one tried; where it cannot read, the reading says why.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

NVIDIA_SMI = "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits"


@dataclass(frozen=True)
class Reading:
    mib: float | None  # summed over the GPUs read; None when nothing could be read
    source: str  # the command, "torch", or why nothing could be read


def used_mib(probe: str | None = None) -> Reading:
    """Used GPU memory in MiB, summed over the GPUs the probe (or nvidia-smi, or torch) sees."""
    if probe:
        return _from_command(probe)
    if shutil.which("nvidia-smi"):
        return _from_command(NVIDIA_SMI)
    return _from_torch()


def _from_command(command: str) -> Reading:
    try:
        run = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
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


def _from_torch() -> Reading:
    try:
        import torch
    except ImportError:
        return Reading(None, "no nvidia-smi on PATH and no torch")
    if not torch.cuda.is_available():
        return Reading(None, "no nvidia-smi on PATH and no CUDA device visible to torch")
    used = 0.0
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        used += (total - free) / 2**20
    return Reading(used, "torch.cuda.mem_get_info")
