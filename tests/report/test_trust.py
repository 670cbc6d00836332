"""The trust panel: caches from their manifests, fetch token checks, online vs offline tau, server outages."""

from __future__ import annotations

import json

import pytest

from dflash_eval.report import stage as report
from tests.support.report_inputs import (
    MISMATCH,
    TAUS,
    report_args,
    section,
    write_metrics,
)


def test_trust_panel_lists_each_cache_from_its_manifest(out):
    markdown = (out / "summary.md").read_text()
    caches = section(markdown, "### Hidden-state caches")
    row = next(line for line in caches.splitlines() if "gsm8k/L1-3" in line)
    for text in (
        "/models/target (qwen3_5_text, 4 layers, config cdcdcdcdcdcd)",
        "| 1, 3 |",
        "| fla |",
        "fla 0.6.0, torch 2.9.0",
        "| bfloat16 |",
        "cuda:0 (NVIDIA H200)",
        "shard_00000.safetensors 5a5a5a5a5a5a<br>shard_00001.safetensors 6b6b6b6b6b6b",
        "(= current file)",
    ):
        assert text in row, text
    stale = next(line for line in caches.splitlines() if "humaneval/L1-3" in line)
    assert "**000000000000 ⚠️ NOT the current file**" in stale
    assert "**Stale cache**" in section(markdown, "## ⚠️ Warnings") and "humaneval/L1-3" in markdown


def test_trust_panel_counts_fetch_token_mismatches_per_evaluation(out):
    markdown = (out / "summary.md").read_text()
    evaluations = section(markdown, "### Per evaluation")
    gsm8k = next(line for line in evaluations.splitlines() if line.startswith("| step-2000 | gsm8k"))
    humaneval = next(line for line in evaluations.splitlines() if line.startswith("| step-2000 | humaneval"))
    assert "**prompt 1, completion 0 of 10 ⚠️**" in gsm8k and "| retokenized 1, server 9 |" in gsm8k
    assert "| prompt 0, completion 0 of 10 |" in humaneval
    assert "**Token mismatch at fetch**: gsm8k: 1 of 10 records" in section(markdown, "## ⚠️ Warnings")


def test_online_tau_is_compared_with_the_served_drafter_and_flagged(out):
    panel = json.loads((out / "trust.json").read_text())
    gsm8k, humaneval = panel["online"]["gsm8k"], panel["online"]["humaneval"]
    # offline: every step-1000 gsm8k sample accepts [4, 4] -> 4.0; online 4.2 -> 5% apart > 3%
    assert gsm8k["drafter"] == "step-1000" and gsm8k["samples_compared"] == 10
    assert gsm8k["online_tau_compared"] == pytest.approx(4.2) and gsm8k["offline_tau_compared"] == 4.0
    assert gsm8k["online_tau_token_weighted"] == pytest.approx(4.2) and gsm8k["method"] == "chain-B4"
    assert gsm8k["online_tau_sglang_compared"] == pytest.approx(4.4) and gsm8k["offline_tau_sglang_compared"] == 4.5
    assert gsm8k["equal_requests"] == 0 and humaneval["equal_requests"] == humaneval["exact_requests"] == 10
    assert gsm8k["relative_difference"] == pytest.approx(0.05) and gsm8k["beyond_tolerance"] is True
    assert humaneval["relative_difference"] == 0.0 and humaneval["beyond_tolerance"] is False
    markdown = (out / "summary.md").read_text()
    assert "**Online ≠ offline**: gsm8k" in markdown and "**Online ≠ offline**: humaneval" not in markdown
    row = next(line for line in section(markdown, "### Online vs offline").splitlines() if line.startswith("| gsm8k"))
    assert row == (
        "| gsm8k | step-1000 | chain-B4 | 10 | 4.200 | 4.000 | +0.2000 (+0.2000, +0.2000) | 4.400 / 4.500 "
        "| 0 of 10 (0 exactly); differ: 0, 1, 2 | **⚠️ beyond 3.0%** |"
    )


def test_server_outages_from_the_transitions_log(out):
    server = json.loads((out / "trust.json").read_text())["server"]
    # pause at 100 (up) -> resume at 160.5: 60.5 s; the pause at 200 found it down; the one at 300 never ended
    assert [o["seconds"] for o in server["outages"]] == [60.5, None]
    assert [o["extractions"] for o in server["outages"]] == [2, 0]  # the joined job's extraction counts in
    assert (server["count"], server["total_s"], server["longest_s"], server["unrestored"]) == (2, 60.5, 60.5, 1)
    markdown = (out / "summary.md").read_text()
    outages = section(markdown, "### Server outages")
    assert "2 outage(s)" in outages and "60.5 s in all, longest 60.5 s" in outages
    assert "| t100 | t160.5 | 60.5 s | yes | 2 |" in outages
    assert "| t300 | – | **never ended ⚠️** | **no ⚠️** | 0 |" in outages
    assert "**Server not restored**: 1 pause(s)" in markdown


def test_trust_json_is_the_panel_and_absent_inputs_say_not_recorded(out, tmp_path):
    panel = json.loads((out / "trust.json").read_text())
    assert [e["drafter"] for e in panel["evaluations"]] == [d for d, _ in TAUS]
    mismatch = next(e for e in panel["evaluations"] if (e["drafter"], e["dataset"]) == MISMATCH)
    assert mismatch["backend_mismatch_allowed"] and mismatch["samples_skipped"] == [
        {"id": "7", "why": "not in the completions file"}
    ]
    assert panel["fetch"]["gsm8k"]["prompt_token_mismatches"] == ["3"]
    assert panel["caches"][0]["argmax_agreement"] == pytest.approx(399 / 400)
    # the same report without completions, manifests or transitions log: nothing fails, all "not recorded"
    assert report.run(report_args(tmp_path, write_metrics(tmp_path))) == 0
    bare = json.loads((tmp_path / "trust.json").read_text())
    assert not bare["server"]["recorded"] and not bare["online"]["gsm8k"]["recorded"]
    assert not bare["fetch"]["gsm8k"]["recorded"] and not bare["caches"][0]["recorded"]
    markdown = (tmp_path / "summary.md").read_text()
    assert "Server transitions: not recorded." in markdown
    assert "| gsm8k | step-1000 | – | – | not recorded (no speculative counters in the completions) |" in markdown


@pytest.mark.parametrize("allowed", [False, True])
def test_a_server_speculating_with_another_drafter_is_flagged_and_refused_unless_allowed(tmp_path, allowed):
    from tests.support.report_inputs import SETTINGS, write_trust_inputs

    hidden, completions, transitions = write_trust_inputs(tmp_path, draft_path="/srv/step-2000")
    settings = {**SETTINGS, "allow_served_drafter_mismatch": allowed}
    assert (
        report.run(
            report_args(
                tmp_path,
                write_metrics(tmp_path),
                settings,
                hidden=hidden,
                completions=completions,
                transitions=transitions,
            )
        )
        == 0
    )
    gsm8k = json.loads((tmp_path / "trust.json").read_text())["online"]["gsm8k"]
    assert gsm8k["served_drafter_check"]["status"] == "mismatch"
    assert gsm8k["compared"] is allowed
    markdown = (tmp_path / "summary.md").read_text()
    assert "**Served drafter ≠ report.served_drafter**: gsm8k: the server speculates with /srv/step-2000" in markdown
    row = next(line for line in section(markdown, "### Online vs offline").splitlines() if line.startswith("| gsm8k"))
    if allowed:
        assert "paired anyway" in markdown and "**⚠️ served drafter mismatch**" in row
    else:
        assert "not compared: the server does not serve report.served_drafter" in row


def test_the_fixtures_server_speculates_with_the_served_drafters_name(out):
    gsm8k = json.loads((out / "trust.json").read_text())["online"]["gsm8k"]
    assert gsm8k["served_drafter_check"]["status"] == "unverified" and gsm8k["compared"]
