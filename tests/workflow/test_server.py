"""The server around a real `snakemake` run of the project's Snakefile: the server is launched by fetch,
down during extraction, healthy after it, and stopped with its whole process group by the Snakefile's
onsuccess/onerror hook, also when the extraction fails.

The stages' computations are replaced by the rerun tests' recorder (src/dflash_eval/testing/workflow.py), but
everything about the server is real: the stand-in `dflash-eval` runs the real `ServerController`
before fetch and the real `server_paused` around extraction, and the real `dflash-eval server` CLI
for the hooks, against a real server process (tests/support/servers.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflash_eval.testing.workflow import check, snakemake, tiny_project
from tests.support import servers as hs
from tests.support.checkout import copy_workflow_with_stand_in

# Each test is one or two real snakemake runs: 84 s and 64 s on the loaded 2-core dev machine
# (2026-11-30), too slow for the default suite. tests/server/test_control.py covers the same mechanics
# (restore on success, failure and SIGTERM; `server finish`; no orphan) in seconds each.
pytestmark = pytest.mark.slow

STAND_IN = r'''#!{python}
"""dflash-eval for the server workflow tests: real server control around fetch and extract, then the
recorder's outputs; `server` is the real CLI."""
import json, os, runpy, sys

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "server":
    from dflash_eval.cli import main
    sys.exit(main(rest))
if rest[0] in ("fetch", "extract"):
    from dflash_eval.server.control import ServerController, server_paused
    server = json.loads(rest[rest.index("--runtime") + 1])["server"]  # how the stage runs, beside its params
    if rest[0] == "fetch":
        ServerController(server).ensure_up()
    else:
        with server_paused(server):
            if os.environ.get("EXTRACT_FAILS"):
                sys.exit("extraction failed on purpose")
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder"), run_name="__main__")
'''


@pytest.fixture
def project(tmp_path):
    """One dataset, one drafter, and a managed tiny server that records each of its starts."""
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", STAND_IN)
    root = tmp_path / "project"
    config = tiny_project(root, drafters=1, datasets=1)
    server = hs.tiny_helper_settings(Path("unused"), "--state", str(root / "server-state.txt"))
    config["server"] = hs.server_config(server)
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return workflow, root


def launched_pids(entries: list[dict]) -> list[int]:
    return [e["pid"] for e in entries if e["event"] == "launched"]


def test_run_takes_the_server_down_around_extraction_and_leaves_no_orphan(project):
    workflow, root = project
    check(snakemake(workflow, root))
    entries = hs.check_down_around_extraction(root / "results" / "logs" / "server" / "transitions.jsonl")
    events = [e["event"] for e in entries]
    assert events[-2:] == ["stop_requested", "down"] and entries[-1]["pid"] == launched_pids(entries)[-1]  # onsuccess
    assert (root / "server-state.txt").read_text().split() == ["started", "started"]  # by fetch; after extraction
    assert all(hs.group_members(pid) == [] for pid in launched_pids(entries))  # no orphan: pids and groups gone
    assert not (root / "results" / "logs" / "server" / "outage.json").exists()


def test_failed_extraction_restores_and_onerror_stops_the_server(project):
    workflow, root = project
    run = snakemake(workflow, root, env={"EXTRACT_FAILS": "1"})
    assert run.returncode != 0 and "extraction failed on purpose" in run.stdout + run.stderr
    entries = hs.check_down_around_extraction(root / "results" / "logs" / "server" / "transitions.jsonl")
    assert next(e for e in entries if e["event"] == "extraction_end")["ok"] is False
    assert [e["event"] for e in entries][-2:] == ["stop_requested", "down"]  # onerror
    assert all(hs.group_members(pid) == [] for pid in launched_pids(entries))


def test_a_second_checkout_on_the_first_ones_port_is_told_whose_server_it_is(project, tmp_path):
    """Issue 32: the second checkout fetched from the first's server silently, then failed with a bare connection
    error. Two workflow directories, one port; the first's server launched by `dflash-eval server up` there."""
    import json
    import shutil
    import subprocess
    import sys

    workflow, first = project
    second = tmp_path / "second"
    shutil.copytree(first, second)  # the same config.yaml: the same port
    up = subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", "server", "up", "--config", "config.yaml"],
        cwd=first,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 0, up.stderr
    record_file = first / "results" / "logs" / "server" / "server.pid"
    record = record_file.read_bytes()
    try:
        run = snakemake(workflow, second)
        text = run.stdout + run.stderr
        assert run.returncode != 0, text
        fetch_log = " ".join(next((second / "results" / "logs" / "fetch").glob("*.log")).read_text().split())
        config = yaml.safe_load((first / "config.yaml").read_text())
        assert f"the server at {config['server']['base_url']} is up, but this checkout did not launch it" in fetch_log
        assert f"it is pid {json.loads(record)['pid']} (`" in fetch_log and f"started in {first}" in fetch_log
        assert f"that checkout's {record_file} has it on record" in fetch_log
        assert f"`cd {first} && dflash-eval server stop-launched --config config.yaml`" in fetch_log
        assert not list((second / "results").glob("completions/*.jsonl")), "nothing fetched from another's server"
        assert record_file.read_bytes() == record and hs.group_members(json.loads(record)["pgid"]), (
            "the first checkout's server is untouched, still on its record"
        )
        assert not (second / "results" / "logs" / "server" / "server.pid").exists()
    finally:
        subprocess.run(
            [sys.executable, "-m", "dflash_eval.cli", "server", "stop-launched", "--config", "config.yaml"],
            cwd=first,
            capture_output=True,
            timeout=120,
        )
    assert hs.group_members(json.loads(record)["pgid"]) == []
