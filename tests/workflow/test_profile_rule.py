"""The profile_server rule in a real Snakemake run: the demo server (managed, restarted per setting) profiled, and
the report's summary.md and trust.json showing the engine's measured step time beside the estimate."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.support import servers as hs
from tests.support.demo_server import demo_server
from tests.support.report_project import (
    REPO,
    report_config,
    report_project,
    report_snakemake,
)

SNAKEFILE = """
from dflash_eval.config import validate_config

configfile: "config.yaml"
config = validate_config(config, "config.yaml")
CONFIG_SOURCE = "config.yaml"

include: "{repo}/workflow/rules/common.smk"
include: "{repo}/workflow/rules/profile.smk"
include: "{repo}/workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
"""


def project(root, **profile):
    results = report_project(root)
    (root / "Snakefile").write_text(SNAKEFILE.format(repo=REPO))
    path = results / "completions" / "humaneval.jsonl"  # the prompts the requests send: ids in the tiny vocabulary
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text(
        "".join(json.dumps({**r, "prompt_token_ids": [5 + i, 6, 7, 8]}) + "\n" for i, r in enumerate(records))
    )
    config = report_config()
    config["profile_server"] = {"enabled": True, "dataset": "humaneval", **profile}
    return results, config


def test_a_server_kind_that_cannot_restart_stops_the_load(tmp_path):
    _, config = project(tmp_path)
    config["server"] = {
        "kind": "external",
        "base_url": "http://127.0.0.1:1",
        "start_command": "true",
        "stop_command": "true",
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run = report_snakemake(tmp_path, "-n")
    assert run.returncode != 0 and "profile_server.enabled needs server.kind: managed" in run.stdout + run.stderr


@pytest.mark.slow
def test_the_rule_profiles_the_demo_server_and_the_report_shows_it(tmp_path):
    results, config = project(tmp_path, acceptance_lengths=[2], requests=2, max_new_tokens=5)
    server, target, drafter = demo_server(tmp_path, extra="--enable-metrics")
    config["server"] = hs.server_config(server)
    config["target"]["path"] = str(target)  # the rule waits for the served models' files, as fetch does
    config["drafters"][config["report"]["served_drafter"]]["path"] = str(drafter)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    run = report_snakemake(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    profile = json.loads((results / "server_profile.json").read_text())
    assert [s["name"] for s in profile["settings"]] == ["no-speculation", "acc-len-2", "served"]
    assert profile["settings"][1]["verify_steps"] == [2, 2]  # 4 tokens after the prefill's, 2 a step
    assert (results / "benchmarks" / "profile_server.tsv").is_file()
    assert "server profile written" in (results / "logs" / "profile_server.log").read_text()
    page = (results / "summary.md").read_text()
    assert "### Measured on your server: profile-server" in page
    assert f"T_step(b4) = {profile['t_step_ms']['4']:.3g} ms" in page
    assert "| acc-len-2 | 2 | 2 |" in page
    trust = json.loads((results / "trust.json").read_text())
    assert trust["server_profile"]["source"] == "user profile (SGLang)"
    assert trust["server_profile"]["datasets"]["humaneval"]["t_step_ms"] == profile["t_step_ms"]["4"]
    # the server was down before the rule and is down after it (no process of its launch left)
    from dflash_eval.server.control import ServerController

    assert not ServerController({**config["server"], "log_dir": str(tmp_path / "results/logs/server")}).is_healthy()
