"""A .pt training checkpoint checked from its size and zip directory alone (checkpoint.pt_archive_problem): what
the workflow can tell at load without reading a tensor, and what the evaluation says when a file went bad after
the load (no advice about allow_pickle: a truncated file is no question of trust)."""

from __future__ import annotations

import pytest
import torch

from dflash_eval.checkpoint import pt_archive_problem
from dflash_eval.checkpoint_weights import read_state
from dflash_eval.errors import DflashEvalError


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "step_5.pt"
    torch.save({"model_state_dict": {"fc.weight": torch.ones(32, 32)}, "global_step": 5}, path)
    return path


def test_a_whole_checkpoint_passes_and_loads(saved):
    assert pt_archive_problem(saved) is None
    state, meta = read_state(saved, "pt", allow_pickle=False)
    assert torch.equal(state["fc.weight"], torch.ones(32, 32)) and meta == {"global_step": 5}


@pytest.mark.parametrize("keep", [0, 1, 100, -22], ids=["empty", "one-byte", "head", "no-directory-end"])
def test_a_truncated_checkpoint_is_named_truncated_at_load_and_at_evaluation(saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    problem = pt_archive_problem(saved)
    assert problem is not None and ("empty" in problem if keep == 0 else "truncated" in problem), problem
    with pytest.raises(DflashEvalError) as error:
        read_state(saved, "pt", allow_pickle=False)
    assert "copy the checkpoint again" in str(error.value) and "allow_pickle" not in str(error.value)


def test_a_legacy_pickle_checkpoint_is_left_to_its_load(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    assert pt_archive_problem(path) is None  # not a zip: only torch.load can tell
