"""The host-wide record of a server outage that extraction jobs share.

One JSON file (`<log_dir>/outage.json`), read and written only under the server's host lock, says
that the server is down because of dflash-eval: whether it was up before (it is restored only then),
how it was taken down (`stopped` or `released`, so that it comes back the same way) and which
processes still need it down. A job that arrives while the server is down joins the outage instead
of restoring the server and stopping it again; the last one out restores it. Holders that died
without leaving (SIGKILL, OOM killer) are pruned by pid and process start time, so the next process
that looks restores what they left down.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_text
from dflash_eval.server.processes import process_start_ticks

HOWS = (None, "stopped", "released")


def this_process() -> dict:
    """This process as an outage holder."""
    return {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid()), "host": socket.gethostname()}


def holder_alive(holder: dict) -> bool:
    """Whether a holder still runs. A holder on another host (a log_dir on a shared file system) cannot
    be checked from here and counts as alive."""
    if holder.get("host") != socket.gethostname():
        return True
    return process_start_ticks(int(holder["pid"])) == holder.get("start_ticks")


@dataclass
class Outage:
    """The server is down because of us (or, with was_up False, kept down while the GPU is in use)."""

    was_up: bool
    how: str | None = None  # how it was taken down: None (it was not), "stopped" or "released"
    holders: list[dict] = field(default_factory=list)
    since: float = field(default_factory=time.time)
    restore_error: str | None = None  # why the last restore failed (retried by the next server need)


def load(path: Path) -> Outage | None:
    """The recorded outage with its dead holders pruned, or None when the server is not held down."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        outage = Outage(
            was_up=bool(data["was_up"]),
            how=data.get("how"),
            holders=list(data.get("holders", [])),
            since=float(data.get("since", 0.0)),
            restore_error=data.get("restore_error"),
        )
        outage.holders = [h for h in outage.holders if holder_alive(h)]  # a malformed holder fails here too
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DflashEvalError(
            f"{path}: not an outage record ({error!r}); bring the server to the state you want by hand, "
            "then delete this file"
        ) from error
    if outage.how not in HOWS:
        raise DflashEvalError(
            f"{path}: `how` is {outage.how!r}, not one of {HOWS}; delete the file once the server "
            "is in the state you want"
        )
    return outage


def save(path: Path, outage: Outage) -> None:
    """Write the record atomically (a crash mid-write must not leave half a file)."""
    atomic_write_text(path, json.dumps(asdict(outage)))


def clear(path: Path) -> None:
    Path(path).unlink(missing_ok=True)
