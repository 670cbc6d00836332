"""The device the demo's target and drafters are trained on (`demo.build_device`), set up to repeat itself.

On the CPU nothing is changed: the thread count the build is given decides the bits, as it always did. On CUDA
the build runs with deterministic algorithms (cuBLAS's fixed workspace, deterministic cuDNN, no TF32, attention by
the math kernel), so that a GPU build is reproducible on the same GPU, torch and CUDA. A CUDA build gives other
models than a CPU build (as two CPU thread counts already do), so the demo's taus are a machine's, not the
project's (docs/demo.md).
"""

from __future__ import annotations

import logging
import os
import re

import torch

from dflash_eval.errors import DflashEvalError

log = logging.getLogger(__name__)

DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")  # the schema's pattern of demo.build_device
CUBLAS_WORKSPACE = ":4096:8"  # what torch's reproducibility notes name for deterministic cuBLAS


def prepare_build_device(device: str) -> torch.device:
    """The torch device for a demo build on `device` ("cpu", "cuda", "cuda:N"), made deterministic on CUDA.

    Call it before anything touches CUDA: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts.
    """
    if not DEVICE_PATTERN.match(device):
        raise DflashEvalError(f"demo build device {device!r}: use cpu, cuda or cuda:N (config.yaml demo.build_device)")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DflashEvalError(
            f"demo.build_device is {device!r} but torch {torch.__version__} sees no CUDA device: "
            "set demo.build_device: cpu, or install a CUDA torch"
        )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    # warn_only: an op without a deterministic CUDA kernel warns instead of failing the build; the GPU test
    # (tests/workflow/test_gpu_demo_build.py) checks that two builds give the same bits
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # attention through plain matmuls: the flash, memory-efficient and cuDNN kernels' backward passes need not
    # repeat themselves (the demo's attention is tiny, the math kernel costs nothing here)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch_device = torch.device(device)
    log.info(
        "demo build on %s (%s), deterministic algorithms on", torch_device, torch.cuda.get_device_name(torch_device)
    )
    return torch_device
