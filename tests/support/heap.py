"""The collector's frozen count as the tests read it, on every CPython the project supports."""

from __future__ import annotations

import functools
import gc


@functools.cache
def interpreter_frozen_count() -> int:
    """What `gc.get_freeze_count()` reads on an unfrozen heap after a full collection: 0, except on CPython 3.12,
    whose full collections put 375 of the interpreter's own objects back in the permanent generation (3.12.1 here,
    3.12.3 on the GPU image; 3.11 and 3.13 read 0). A test that runs `gc.collect()` (a report's plots, say) then
    reads 375 without anything having called `gc.freeze()`. Measured once, at the session's start (conftest)."""
    gc.unfreeze()
    gc.collect()
    return gc.get_freeze_count()


def unfrozen() -> bool:
    """No more frozen than the interpreter's own (see interpreter_frozen_count)."""
    return gc.get_freeze_count() <= interpreter_frozen_count()
