"""Which workflow run a managed server belongs to, so that the next run can tell a server that a dead run
left behind (its end-of-run hook never ran: a second Ctrl-C kills Snakemake mid-shutdown) from one that a
live run, or the user (`dflash-eval server up` by hand), keeps.

The Snakefile marks its own process as the run (`DFLASH_EVAL_RUN`, pid, start time and host) when it loads;
every job inherits the variable, so a server that fetch or extraction launches is recorded in `server.pid`
with that run as its owner. A server launched outside a run has no owner and is never taken for an orphan.
"""

from __future__ import annotations

import json
import os

from dflash_eval.server import outage

RUN_ENV = "DFLASH_EVAL_RUN"


def current_run() -> dict | None:
    """The run this process belongs to (from the environment), or None outside a workflow run."""
    text = os.environ.get(RUN_ENV)
    if not text:
        return None
    try:
        run = json.loads(text)
        return run if isinstance(run, dict) and "pid" in run else None
    except ValueError:
        return None


def start_run() -> bool:
    """Mark this process as a workflow run unless it runs inside one already (a job, or a cluster job's
    Snakemake, inherits the variable); True when this process is the run itself."""
    if current_run() is not None:
        return False
    os.environ[RUN_ENV] = json.dumps(outage.this_process())
    return True


def same_run(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in ("pid", "start_ticks", "host"))


def run_alive(run: dict) -> bool:
    """Whether the run still runs (one on another host counts as alive: it cannot be checked from here)."""
    return outage.holder_alive(run)
