"""What a run that died mid-restore leaves behind (issue 32), with real processes: an outage record whose holder
was SIGKILLed while the server it relaunched runs, and a managed server whose owning run is gone. The next
extraction takes such a server down again before it relies on the outage; the next run's start ends both."""

from __future__ import annotations

import json
import subprocess
import sys

from dflash_eval.server.control import ServerController
from tests.support import servers as hs
from tests.support.server_control import entries, make, pauser, transitions

LAUNCH_AS_A_RUN = (
    "import json, sys\n"
    "from dflash_eval.server.control import ServerController\n"
    "from dflash_eval.server.runs import start_run\n"
    "assert start_run()\n"
    "ServerController(json.loads(sys.argv[1])).ensure_up()\n"
)


def _stale_outage_with_the_server_up(ctl: ServerController) -> None:
    """An extraction SIGKILLed inside its outage, then the server brought up without ending the record (what a
    restore cut short between its launch and its record leaves)."""
    proc = pauser(ctl.settings, 60)
    assert proc.stdout.readline().strip() == "inside"
    proc.kill()
    proc.wait()
    ctl.server.start("stopped")  # the relaunch, with the outage still recorded
    assert ctl.is_healthy() and ctl.outage_file.exists()


def test_an_extraction_does_not_join_a_stale_outage_while_the_server_runs(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    ctl.ensure_up()
    _stale_outage_with_the_server_up(ctl)
    stale_pid = ctl.launched_pid()
    flag = tmp_path / "go"
    proc = pauser(ctl.settings, 0, until=flag)
    assert proc.stdout.readline().strip() == "inside"
    assert not ctl.is_healthy() and hs.group_members(stale_pid) == []  # down for the extraction, as it must be
    flag.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "no live job held: taking it down again" in err
    assert ctl.is_healthy() and not ctl.outage_file.exists()
    events = transitions(tmp_path / "logs")
    assert events[events.index("stale_outage") :][:3] == ["stale_outage", "stop_requested", "down"]
    assert events[-1] == "resume"


def test_the_next_run_ends_a_stale_outage_and_an_orphan_server_in_one_line(tmp_path, controllers):
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    ctl = make(controllers, settings)
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH_AS_A_RUN, json.dumps(settings)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    owner = json.loads((tmp_path / "logs" / "server.pid").read_text())["owner"]
    assert owner["pid"] == next(e["by_pid"] for e in entries(tmp_path / "logs") if e["event"] == "launched")
    _stale_outage_with_the_server_up(ctl)  # relaunched here, outside a run: no owner on record
    record = json.loads((tmp_path / "logs" / "server.pid").read_text())
    record["owner"] = owner  # as an extraction job of that run would have recorded it
    (tmp_path / "logs" / "server.pid").write_text(json.dumps(record))
    pgid, outage_before = record["pgid"], ctl.outage_file.read_text()

    dry = ctl.reclaim(act=False)  # `snakemake -n`: says, changes nothing
    assert dry.startswith("dflash-eval: found an outage that no live job holds") and "dry run" in dry
    assert ctl.outage_file.read_text() == outage_before and hs.group_members(pgid)

    line = ctl.reclaim()
    assert "\n" not in line and f"that run {owner['pid']} launched" in line, line
    assert "forgot the outage" in line and "stopped that server with its process group" in line
    assert not ctl.outage_file.exists() and hs.group_members(pgid) == [] and not ctl.is_healthy()
    assert ctl.reclaim() is None  # nothing left: the next start says nothing
    ctl.ensure_up()  # and the run's fetch launches the server as usual
    assert ctl.is_healthy()
