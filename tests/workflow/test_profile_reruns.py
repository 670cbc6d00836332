"""The profile_server rule's reruns, asked of the real Snakefile (the plan after each change, as test_reruns.py
does): a missing results/server_profile.json is rebuilt by a plain run (after the profile job failed or was
killed, the report must not keep the old profile); only what decides the measurement (the server's command, its
model, the acceptance lengths) re-profiles the server, never a port, health_timeout_s or stop_grace_s, whose new
values still reach the job (its --runtime)."""

from __future__ import annotations

import json

import pytest

from dflash_eval.testing.workflow import (
    check,
    job,
    load_config,
    plan,
    save_config,
    snakemake,
    tiny_project,
)
from tests.support.checkout import copy_workflow_with_stand_in
from tests.support.finished_project import copy_of

STAND_IN = r'''#!{python}
"""The recorder, and for profile-server: its output written, its call and --runtime logged."""
import json, os, runpy, sys

args = sys.argv[1:]
rest = args[2:] if args[:1] == ["--log"] else args
if rest[0] == "profile-server":
    opts = {{rest[i]: rest[i + 1] for i in range(len(rest) - 1) if rest[i].startswith("--")}}
    with open("profile_calls.log", "a") as log:
        log.write(json.dumps({{"settings": json.loads(opts["--settings"]), "runtime": json.loads(opts["--runtime"])}})
                  + "\n")
    with open(opts["--out"], "w") as out:
        out.write(opts["--settings"])
    sys.exit(0)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorder"), run_name="__main__")
'''
COMMAND = "serve --port {port} --speculative-algorithm DFLASH --speculative-num-draft-tokens 4 --enable-metrics"
PROFILE = "profile_server results/server_profile.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile-reruns")
    workflow = copy_workflow_with_stand_in(root / "workflow", STAND_IN)
    project = root / "base"
    config = tiny_project(project, drafters=1, datasets=1)
    config["server"]["command"] = COMMAND.format(port=9)
    config["profile_server"] = {"enabled": True, "acceptance_lengths": [2, 4], "requests": 2, "max_new_tokens": 5}
    save_config(project, config)
    check(snakemake(workflow, project))
    assert (project / "results" / "server_profile.json").exists()
    return workflow, project


@pytest.fixture
def case(base, tmp_path):
    workflow, project = base
    return workflow, copy_of(project, tmp_path / "case", ("calls.log", "profile_calls.log"))


def test_a_missing_server_profile_is_rebuilt_by_a_plain_run(case):
    workflow, root = case
    assert plan(workflow, root) == set()
    (root / "results" / "server_profile.json").unlink()  # what a failed or killed profile job leaves
    assert plan(workflow, root) == {PROFILE, job("report")}
    check(snakemake(workflow, root))
    assert (root / "results" / "server_profile.json").exists() and plan(workflow, root) == set()


def test_server_handling_settings_rerun_no_profile_and_still_reach_it(case):
    workflow, root = case
    config = load_config(root)
    config["server"].update(
        base_url="http://127.0.0.1:10", command=COMMAND.format(port=10), health_timeout_s=1234, stop_grace_s=7
    )
    config["profile_server"]["timeout_s"] = 99
    save_config(root, config)
    assert plan(workflow, root) == set()
    check(snakemake(workflow, root, "--forcerun", "profile_server"))
    call = json.loads((root / "profile_calls.log").read_text().splitlines()[-1])
    server = call["runtime"]["server"]
    assert server["base_url"].endswith(":10") and server["command"] == COMMAND.format(port=10)
    assert server["health_timeout_s"] == 1234 and server["stop_grace_s"] == 7 and call["runtime"]["timeout_s"] == 99
    assert call["settings"]["server"] == {"command": COMMAND.format(port="PORT"), "model": None}


@pytest.mark.parametrize("change", ["command", "model", "acceptance_lengths"])
def test_what_decides_the_measurement_re_profiles(case, change):
    workflow, root = case
    config = load_config(root)
    if change == "command":
        config["server"]["command"] = COMMAND.format(port=9).replace("draft-tokens 4", "draft-tokens 8")
    elif change == "model":
        config["server"]["model"] = "another"
    else:
        config["profile_server"]["acceptance_lengths"] = [2, 4, 8]
    save_config(root, config)
    assert plan(workflow, root) == {PROFILE, job("report")}
