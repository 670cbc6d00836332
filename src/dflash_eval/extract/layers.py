"""Layer ids of the target, checked without torch: the workflow checks every drafter's list when it loads."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_eval.errors import DflashEvalError


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Layer ids as a list, each in [0, num_layers), without repeats."""
    if not isinstance(layer_ids, (list, tuple)):
        raise DflashEvalError(
            f"layer_ids must be a list of layer ids such as [1, 16, 31], got {layer_ids!r} "
            "(in settings written by hand: give the drafter's target_layer_ids)"
        )
    ids = list(layer_ids)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise DflashEvalError(
            f"layer ids {bad} out of range: the target has {num_layers} decoder layers, so ids must be in "
            f"0..{num_layers - 1} (id i = output of decoder layer i)"
        )
    if not ids or len(set(ids)) != len(ids):
        raise DflashEvalError(f"layer ids {ids} must be a non-empty list without repeats")
    return ids
