"""Index arrays from the host to the drafter's device in one copy.

On a GPU a round of the trajectory evaluator is bound by what the host issues, and a copy from pageable
memory is a blocking call of its own: so a forward's integer arrays go into one pinned buffer and cross
in one asynchronous copy (the caching host allocator keeps the buffer until the copy has read it). On the
CPU the arrays are used where they lie.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device` holding `arrays` (any shapes), in the same order."""
    arrays = [np.asarray(array, dtype=np.int64) for array in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(array) for array in arrays]
    sizes = [array.size for array in arrays]
    buffer = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    host = buffer.numpy()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for array, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
        host[lo:hi] = array.reshape(-1)
    flat = buffer.to(device, non_blocking=True)
    return [flat[lo:hi].view(array.shape) for array, lo, hi in zip(arrays, offsets[:-1], offsets[1:])]
