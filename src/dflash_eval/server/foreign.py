"""Whose a healthy server on our port is, when this checkout did not launch it (two checkouts on one
port). Without this the second checkout fetched from the first's server (perhaps another model), then failed
with a bare connection error when the first's run stopped it at its end, or with "not launched by dflash-eval"
when its extraction tried to take it down.

Found from /proc: the process listening on the port, its working directory (the checkout a workflow run or
`dflash-eval server up` started it in), the workflow run in its environment (runs.RUN_ENV) and that
checkout's server.pid, when it names the same process group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_eval.server.processes import port_holder, process_facts
from dflash_eval.server.runs import RUN_ENV, run_alive

SIMULATE_ENV = "SGLANG_SIMULATE_ACC_LEN"  # SGLang 0.5.23 speculative/spec_utils.py: forces the acceptance length


def whose(port: int, log_dir: str | Path) -> tuple[str, str]:
    """(who holds the port, what to do about it), in words for the error message."""
    pid = port_holder(port)
    if pid is None:
        return (
            "a process this host does not show (another user's, or one in a container behind a forwarded port)",
            "stop it where it runs",
        )
    facts = process_facts(pid)
    switch = (facts["environ"] or {}).get(SIMULATE_ENV)  # SGLang's fake acceptance: never to be measured from
    who = f"pid {pid}" + (f" (`{facts['cmdline'][:200]}`)" if facts["cmdline"] else "")
    if switch is not None:
        who += f" with {SIMULATE_ENV}={switch} in its environment (a simulated-acceptance server)"
    cwd = facts["cwd"]
    if cwd is not None:
        who += f", started in {cwd}"
    run = _run(facts["environ"])
    if run is not None:
        state = "still running" if run_alive(run) else "gone"
        who += f" by the workflow run of pid {run.get('pid')} ({state})"
    record = _record(Path(cwd), Path(log_dir), pid) if cwd is not None else None
    if record is not None:
        who += f"; that checkout's {record} has it on record"
        return who, f"stop it from there (`cd {cwd} && dflash-eval server stop-launched --config config.yaml`)"
    return who, f"stop it (`kill {pid}`)"


def _run(environ: dict | None) -> dict | None:
    try:
        run = json.loads((environ or {}).get(RUN_ENV) or "null")
    except ValueError:
        return None
    return run if isinstance(run, dict) and "pid" in run else None


def _record(cwd: Path, log_dir: Path, pid: int) -> Path | None:
    """`<cwd>/<log_dir>/server.pid` when it names the process group of `pid` (the other checkout's own record)."""
    path = (log_dir if log_dir.is_absolute() else cwd / log_dir) / "server.pid"
    try:
        return path if int(json.loads(path.read_text())["pgid"]) == os.getpgid(pid) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
