"""Two Ctrl-C during extraction, and SIGTERM during the restore, in a real `snakemake` run (issue 32).

The signals go to Snakemake's process group, as a terminal sends a user's Ctrl-C: Snakemake and the
extraction job get each one. The second may kill Snakemake before its end-of-run hook runs; the job's restore
must still finish (shielded), leaving a known state: the server healthy, on record in server.pid with the run
that launched it, and no outage record. The next run, when it loads, stops that server (its run is gone) and
says so in one line; nothing already written (the completions) is lost or fetched again.

As in test_server.py, the stages' computations are the recorder's (src/dflash_eval/testing/workflow.py), while
all about the server is real: the real server_paused around the extraction (which waits, to be interrupted),
the real ServerController before fetch, the real Snakefile load, a real server process (tests/support/servers.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_eval.testing.workflow import check, snakemake, tiny_project
from tests.support import servers as hs
from tests.support.checkout import copy_workflow_with_stand_in

pytestmark = pytest.mark.slow  # real snakemake runs, tens of seconds each on the 2-core dev machine

STAND_IN = r'''#!{python}
"""dflash-eval for these tests: real server control around fetch and a long extraction, then the recorder."""
import json, os, runpy, sys, time

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "server":
    from dflash_eval.cli import main
    sys.exit(main(rest))
if rest[0] in ("fetch", "extract"):
    from dflash_eval.server.control import ServerController, server_paused
    server = json.loads(rest[rest.index("--runtime") + 1])["server"]
    if rest[0] == "fetch":
        ServerController(server).ensure_up()
    else:
        with server_paused(server):
            time.sleep(float(os.environ.get("EXTRACT_SECONDS", "0")))
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder"), run_name="__main__")
'''


@pytest.fixture
def project(tmp_path):
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", STAND_IN)
    root = tmp_path / "project"
    config = tiny_project(root, drafters=1, datasets=1)
    server = hs.tiny_helper_settings(Path("unused"))
    server["command"] = "sleep 2; " + server["command"]  # each (re)launch takes 2 s: the second signal lands in it
    config["server"] = hs.server_config(server)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return workflow, root


def _entries(root: Path) -> list[dict]:
    path = root / "results" / "logs" / "server" / "transitions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.02)


def _restore_begun(root: Path) -> bool:
    events = [e["event"] for e in _entries(root)]
    return "extraction_end" in events and "launched" in events[events.index("extraction_end") :]


def _interrupted_run(workflow: Path, root: Path, second: signal.Signals) -> tuple[int, str]:
    """Snakemake in a session of its own (as in a terminal); SIGINT to its group during the extraction, then
    `second` to the group once the restore has begun. Returns Snakemake's pid and all it and its jobs wrote."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(workflow / "src"),
        "EXTRACT_SECONDS": "120",
        "PATH": f"{workflow / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DFLASH_EVAL_RUN", None)
    output = root / "interrupted-run.txt"
    with open(output, "w") as out:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "snakemake",
                "--snakefile",
                str(workflow / "Snakefile"),
                "--directory",
                str(root),
                "--configfile",
                str(root / "config.yaml"),
                "--workflow-profile",
                str(workflow / "profiles" / "default"),
                "--cores",
                "2",
            ],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(lambda: "extraction_start" in [e["event"] for e in _entries(root)], 240, "extraction_start")
        time.sleep(0.5)
        os.killpg(run.pid, signal.SIGINT)  # the first Ctrl-C
        _wait_for(lambda: _restore_begun(root), 60, "relaunch after extraction_end")
        os.killpg(run.pid, second)  # the second Ctrl-C (or a SIGTERM) while the job restores the server
        run.wait(timeout=120)
        _wait_for(lambda: hs.group_members(run.pid) == [], 120, "end of the job processes")  # the job finished too
    finally:
        if run.poll() is None:
            run.kill()
    job_log = root / "results" / "logs" / "extract" / "d1" / "L1-2.log"  # the job's stderr
    return run.pid, output.read_text() + (job_log.read_text() if job_log.exists() else "")


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["double-ctrl-c", "sigterm-in-cleanup"])
def test_a_second_signal_during_the_restore_ends_in_a_known_state_that_the_next_run_ends(project, second):
    workflow, root = project
    completions = root / "results" / "completions" / "d1.jsonl"
    run_pid, text = _interrupted_run(workflow, root, second)
    log_dir = root / "results" / "logs" / "server"
    entries = _entries(root)
    events = [e["event"] for e in entries]
    assert next(e for e in entries if e["event"] == "extraction_end")["ok"] is False
    assert "received again while the server is being restored: finishing the restore first" in text, text[-3000:]
    # the restore finished: healthy, the outage ended, the relaunched server on record
    after = events[events.index("extraction_end") :]
    assert (
        "healthy" in after
        and next(e for e in entries[events.index("extraction_end") :] if e["event"] == "resume")["restored"]
    )
    assert not (log_dir / "outage.json").exists()
    relaunched = [e["pid"] for e in entries if e["event"] == "launched"][-1]
    record = json.loads((log_dir / "server.pid").read_text()) if (log_dir / "server.pid").exists() else None
    stopped_by_hook = events[-1] == "down"  # Snakemake lived to run onerror: it stopped the server itself
    if not stopped_by_hook:
        assert record is not None and record["pgid"] == relaunched and record["owner"]["pid"] == run_pid
        assert hs.group_members(relaunched), "the restored server runs, owned by a run that is gone"
    assert completions.exists()
    written = completions.read_bytes()

    # the next run ends what the dead run left, in one line, and loses nothing
    rerun = check(snakemake(workflow, root))
    lines = [line for line in rerun.splitlines() if line.startswith("dflash-eval: found")]
    if stopped_by_hook:
        assert lines == []
    else:
        assert len(lines) == 1 and f"that run {run_pid} launched" in lines[0], rerun[-3000:]
        assert "stopped that server with its process group" in lines[0]
        stop = next(e for e in _entries(root)[len(entries) :] if e["event"] == "stop_requested")
        assert stop["pid"] == record["pid"] and "which is gone" in stop["reason"]
    assert hs.group_members(relaunched) == []
    assert completions.read_bytes() == written
    assert (root / "calls.log").read_text().count("fetch ") == 1  # the completions were not fetched again
    assert not (log_dir / "outage.json").exists()


TWO_RUNS_STAND_IN = r'''#!{python}
"""dflash-eval for the two-runs test: fetch makes the server healthy (real server control), holds it for
FETCH_SECONDS, then says whether it is still up; everything else is the recorder's."""
import json, os, runpy, sys, time

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "server":
    from dflash_eval.cli import main
    sys.exit(main(rest))
if rest[0] == "fetch":
    from dflash_eval.server.control import ServerController
    ctl = ServerController(json.loads(rest[rest.index("--runtime") + 1])["server"])
    ctl.ensure_up()
    with open(os.environ["FETCH_LOG"], "a") as log:
        log.write("fetching\n")
    time.sleep(float(os.environ.get("FETCH_SECONDS", "0")))
    with open(os.environ["FETCH_LOG"], "a") as log:
        log.write(f"still up: {{ctl.is_healthy()}}\n")
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder"), run_name="__main__")
'''


def test_a_second_run_s_end_does_not_stop_the_first_run_s_server_mid_fetch(tmp_path):
    """Issue 45's BAD case with two real `snakemake` runs in one checkout (disjoint targets, which Snakemake's lock
    lets through): the long run launches the server and fetches; the short run fetches from it and ends; its
    end-of-run hook leaves the server to the long run, whose fetch finds it still up; the long run's end stops it,
    and no process of it is left."""
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", TWO_RUNS_STAND_IN)
    root = tmp_path / "project"
    config = tiny_project(root, drafters=1, datasets=2)
    server = hs.tiny_helper_settings(Path("unused"))
    config["server"] = hs.server_config(server)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(workflow / "src"),
        "PATH": f"{workflow / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DFLASH_EVAL_RUN", None)
    argv = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(workflow / "Snakefile"),
        "--directory",
        str(root),
        "--configfile",
        str(root / "config.yaml"),
        "--workflow-profile",
        str(workflow / "profiles" / "default"),
        "--cores",
        "1",
    ]
    long_log, short_log = tmp_path / "long.txt", tmp_path / "short.txt"
    with open(tmp_path / "long.out", "w") as out:
        long_run = subprocess.Popen(
            [*argv, "results/completions/d1.jsonl"],
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "FETCH_SECONDS": "25", "FETCH_LOG": str(long_log)},
        )
    try:
        _wait_for(lambda: long_log.exists(), 120, "the long run's fetch")
        short = subprocess.run(
            [*argv, "results/completions/d2.jsonl"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "FETCH_SECONDS": "0", "FETCH_LOG": str(short_log)},
        )
        assert short.returncode == 0, short.stdout[-3000:] + short.stderr[-3000:]
        assert short_log.read_text().splitlines() == ["fetching", "still up: True"]
        assert f"workflow run {long_run.pid}, still running, launched or uses it" in short.stdout + short.stderr
        record = json.loads((root / "results" / "logs" / "server" / "server.pid").read_text())
        assert record["owner"]["pid"] == long_run.pid and hs.group_members(record["pgid"])
        assert long_run.wait(timeout=300) == 0, (tmp_path / "long.out").read_text()[-3000:]
    finally:
        if long_run.poll() is None:
            long_run.kill()
    assert long_log.read_text().splitlines() == ["fetching", "still up: True"], "the short run stopped it mid-fetch"
    assert hs.group_members(record["pgid"]) == []  # the long run's end stopped it
    assert (root / "results" / "completions" / "d1.jsonl").exists()
    assert (root / "results" / "completions" / "d2.jsonl").exists()
    stop = [e for e in _entries(root) if e["event"] == "stop_requested"]
    assert len(stop) == 1 and stop[0]["by_run"] == long_run.pid and stop[0]["reason"] == "end of run"
