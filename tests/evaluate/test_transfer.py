"""A forward's index arrays reach the device in one copy, unchanged in values, shapes and order."""

import numpy as np
import pytest
import torch

from dflash_eval.evaluate.transfer import to_device


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(-5, 1 << 40, size=(3, 4)),
        np.arange(7),
        np.array([], dtype=np.int64),
        np.array([[1], [2]], dtype=np.int32),
    ]


def _check(moved: list[torch.Tensor], arrays: list[np.ndarray], device: torch.device) -> None:
    assert len(moved) == len(arrays)
    for tensor, array in zip(moved, arrays):
        assert tensor.device.type == device.type and tensor.dtype == torch.int64
        assert tuple(tensor.shape) == array.shape
        np.testing.assert_array_equal(tensor.cpu().numpy(), array)


def test_on_the_cpu_the_arrays_are_used_where_they_lie():
    arrays = _arrays()
    moved = to_device(arrays, torch.device("cpu"))
    _check(moved, arrays, torch.device("cpu"))
    assert moved[0].data_ptr() == arrays[0].ctypes.data  # int64 already: no copy


@pytest.mark.gpu
def test_on_a_gpu_one_pinned_copy_and_a_reused_buffer_does_not_corrupt_the_last():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    first = _arrays()
    later = [array + 1 for array in first]
    torch.cuda._sleep(50_000_000)  # the stream stays busy: the first copy still waits when the second buffer is written
    moved = to_device(first, device)
    again = to_device(later, device)
    _check(moved, first, device)
    _check(again, later, device)
