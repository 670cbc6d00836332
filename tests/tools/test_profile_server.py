"""dflash-eval profile-server: its pieces by hand, and a real run against the demo server (the managed kind,
restarted once per setting) whose step times move with the forced acceptance length as that server's timing implies."""

from __future__ import annotations

import json
import math

import pytest

from dflash_eval.cache.serving_profile import check_profile
from dflash_eval.config import stage_settings
from dflash_eval.errors import DflashEvalError
from dflash_eval.server.control import ServerController
from dflash_eval.tools import profile_server as sp
from tests.support.demo_server import BLOCK, demo_server

NEW = 13  # 12 tokens after the prefill's: k = 1, 2, 4 take 12, 6 and 3 steps (block 4)


def test_the_command_without_speculation_by_hand():
    command = (
        "env OMP_NUM_THREADS=1 dflash-eval demo-server --port 1 --speculative-algorithm DFLASH "
        "--speculative-draft-model-path 'my dir/d' --speculative-num-draft-tokens=8 --enable-metrics"
    )
    assert (
        sp.command_without_speculation(command) == "env OMP_NUM_THREADS=1 dflash-eval demo-server --port 1 "
        "--enable-metrics"
    )
    with pytest.raises(DflashEvalError, match="no --speculative-"):
        sp.command_without_speculation("python -m sglang.launch_server --port 1")


def test_a_request_s_numbers_by_hand():
    meta = {"e2e_latency": 1.2, "first_token_latency": 0.2, "completion_tokens": 11, "spec_verify_ct": 4}
    row = sp.request_numbers(meta, speculates=True)
    assert row["decode_ms_per_token"] == pytest.approx(100.0)  # 1 s over the 10 tokens after the first
    assert row["ms_per_step"] == pytest.approx(250.0) and row["tokens_per_step"] == pytest.approx(2.5)
    assert (
        sp.expected_steps(13, 2, 4) == 6 and sp.expected_steps(13, 8, 4) == 3 and sp.expected_steps(13, 2.5, 4) is None
    )
    with pytest.raises(DflashEvalError, match="spec_verify_ct"):
        sp.request_numbers({**meta, "spec_verify_ct": 0}, speculates=True)
    out = sp.spread([5.0, 1.0, 3.0, 2.0, 4.0, 6.0])
    assert out["median"] == 3.5 and out["ci95"] == [1.0, 6.0] and (out["min"], out["max"], out["n"]) == (1.0, 6.0, 6)
    assert sp.spread([1.0, 2.0])["ci95"] is None  # 2 requests give no 95% interval of the median


def config(**profile):
    return {
        "server": {"kind": "managed", "command": "serve --speculative-algorithm DFLASH --enable-metrics"},
        "datasets": {"a": {}},
        "profile_server": {"enabled": True, **profile},
    }


def test_what_stops_the_rule_at_load():
    assert sp.problems(config()) == []
    assert sp.problems({**config(), "profile_server": {"enabled": False}}) == []
    external = config()
    external["server"] = {"kind": "external"}
    assert "server.kind: managed" in sp.problems(external)[0]
    no_metrics = config()
    no_metrics["server"]["command"] = "serve --speculative-algorithm DFLASH"
    assert "lacks --enable-metrics" in sp.problems(no_metrics)[0]
    assert "not one of datasets" in sp.problems(config(dataset="b"))[0]
    assert "must not speculate" in sp.problems(config(command_no_spec="serve --speculative-x 1 --enable-metrics"))[0]


def test_a_variant_exports_its_switch_before_a_compound_command(tmp_path):
    out = sp.variant({"log_dir": str(tmp_path), "command": "x"}, "acc-len-2", "cd a && serve", {sp.SWITCH: "2"})
    assert out["command"] == "export SGLANG_SIMULATE_ACC_LEN=2; cd a && serve"
    assert out["log_dir"] == str(tmp_path)  # the configured server's record: every cleanup path reads it


@pytest.mark.slow
def test_profile_against_the_demo_server_restarted_per_setting(tmp_path):
    """Five launches (no speculation, k 1, 2, 4, then the configured server restored). Each request's verify steps
    are ceil(12 / k); the demo server runs the drafter and a full-block verify every step whatever k commits, so
    its step time stays put while its decode time per token falls as 1 / k; the configured server is up again
    afterwards, relaunched."""
    server, _target, _drafter = demo_server(tmp_path, extra="--enable-metrics")  # block 4, as the simulate tests
    settings = stage_settings(
        "profile_server", {"server": server, "acceptance_lengths": [1, 2, 4], "requests": 6, "max_new_tokens": NEW}
    )
    ctl = ServerController(server)
    ctl.ensure_up()
    before = ctl.launched_pid()
    try:
        prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
        result = sp.profile(settings, prompts)
        assert ctl.is_healthy() and ctl.launched_pid() not in (None, before)  # restored: relaunched, ours
    finally:
        ctl.stop_if_launched()
    check_profile(json.loads(json.dumps(result)), "profile.json")
    # the report's outage table counts this pause as a profile-server run, not as an extraction
    from dflash_eval.report.trust import server_outages
    from dflash_eval.report.trust_section import outage_lines

    outages = server_outages(f"{server['log_dir']}/transitions.jsonl")
    assert [(o["extractions"], o["profiles"], o["restored"]) for o in outages["outages"]] == [(0, 1, True)]
    table = outage_lines(outages)
    assert table[2].endswith("| extractions | profile-server runs |") and table[4].endswith("| 0 | 1 |"), table
    by_name = {s["name"]: s for s in result["settings"]}
    assert list(by_name) == ["no-speculation", "acc-len-1", "acc-len-2", "acc-len-4", "served"]
    assert "--speculative" not in by_name["no-speculation"]["command"]
    assert by_name["no-speculation"]["completion_tokens"] == [NEW] * 6  # ignore_eos: every request runs to NEW
    assert by_name["acc-len-2"]["command"].startswith("export SGLANG_SIMULATE_ACC_LEN=2; ")
    for k in (1, 2, 4):
        s = by_name[f"acc-len-{k}"]
        assert s["completion_tokens"] == [NEW] * 6  # the fixed token mode never meets a stop token
        assert s["verify_steps"] == [math.ceil((NEW - 1) / k)] * 6
        assert s["tokens_per_step"]["median"] == pytest.approx(k)
        assert s["ms_per_step"]["ci95"] is not None and s["restart_s"] > 0
    step = {k: by_name[f"acc-len-{k}"]["ms_per_step"]["median"] for k in (1, 2, 4)}
    per_token = {k: by_name[f"acc-len-{k}"]["decode_ms_per_token"]["median"] for k in (1, 2, 4)}
    assert 0.5 < step[4] / step[1] < 2.0  # a step costs about the same whatever it commits
    assert 2.0 < per_token[1] / per_token[4] < 8.0  # so the time per token falls about as 1 / k (4x)
    assert step[1] > result["t_ar_ms"]  # a step drafts and verifies a block; a plain decode step is one forward
    assert result["t_ar_ms"] == by_name["no-speculation"]["decode_ms_per_token"]["median"]
    assert result["block_size"] == BLOCK and set(result["t_step_ms"]) == {str(BLOCK)}
    assert by_name["served"]["restart_s"] is None  # it was up: the pause restored it
