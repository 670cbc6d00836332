"""server.shares_target_gpu in a real `snakemake` run (config/gpu.yaml sets it false: its demo server serves on
the CPU). False: the server is launched once and keeps serving through extraction, nothing is paused, and the
fetches of two datasets run side by side (no server_lock). The default (true): extraction pauses the server and
the two fetches run one after the other. Stages replaced by the recorder as in test_server.py; the server control
(ServerController, server_paused) and the server process are real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_eval.testing.workflow import check, snakemake, tiny_project
from tests.support import servers as hs
from tests.support.checkout import copy_workflow_with_stand_in

pytestmark = pytest.mark.slow  # two real snakemake runs

STAND_IN = r'''#!{python}
"""dflash-eval: real server control around fetch (which takes 3 s, to see overlaps) and extract, then the
recorder's outputs; each stage's start and end, and the server's health inside extraction, in stages.jsonl."""
import json, os, runpy, sys, time

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "server":
    from dflash_eval.cli import main
    sys.exit(main(rest))

def note(**entry):
    with open("stages.jsonl", "a") as f:
        f.write(json.dumps(dict(entry, t=time.time())) + "\n")

if rest[0] in ("fetch", "extract"):
    from dflash_eval.server.control import ServerController, server_paused
    server = json.loads(rest[rest.index("--runtime") + 1])["server"]
    out = rest[rest.index("--out") + 1]
    if rest[0] == "fetch":
        ServerController(server).ensure_up()
        note(stage="fetch", out=out, at="start")
        time.sleep(3)
        note(stage="fetch", out=out, at="end")
    else:
        with server_paused(server):
            note(stage="extract", out=out, healthy=ServerController(server).is_healthy())
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder"), run_name="__main__")
'''


def run_project(tmp_path: Path, shares: bool | None) -> tuple[Path, list[dict], list[str]]:
    workflow = copy_workflow_with_stand_in(tmp_path / "workflow", STAND_IN)
    root = tmp_path / "project"
    config = tiny_project(root, drafters=1, datasets=2)
    server = hs.server_config(hs.tiny_helper_settings(Path("unused"), "--state", str(root / "server-state.txt")))
    config["server"] = server if shares is None else {**server, "shares_target_gpu": shares}
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    check(snakemake(workflow, root, "--cores", "4"))
    stages = [json.loads(line) for line in (root / "stages.jsonl").read_text().splitlines()]
    events = [
        json.loads(line)["event"] for line in (root / "results/logs/server/transitions.jsonl").read_text().splitlines()
    ]
    return root, stages, events


def fetches_overlap(stages: list[dict]) -> bool:
    spans = {}
    for entry in (s for s in stages if s["stage"] == "fetch"):
        spans.setdefault(entry["out"], {})[entry["at"]] = entry["t"]
    (a, b) = spans.values()
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_a_server_off_the_target_gpu_serves_through_extraction_and_both_fetches_at_once(tmp_path):
    root, stages, events = run_project(tmp_path, shares=False)
    extractions = [s for s in stages if s["stage"] == "extract"]
    assert len(extractions) == 2 and all(s["healthy"] for s in extractions)
    assert "pause" not in events and "extraction_start" not in events
    assert (root / "server-state.txt").read_text().split() == ["started"]  # launched once, for the whole run
    assert fetches_overlap(stages)


def test_by_default_extraction_pauses_the_server_and_fetches_take_turns(tmp_path):
    root, stages, events = run_project(tmp_path, shares=None)
    extractions = [s for s in stages if s["stage"] == "extract"]
    assert len(extractions) == 2 and not any(s["healthy"] for s in extractions)
    assert "pause" in events and "extraction_start" in events
    assert not fetches_overlap(stages)
