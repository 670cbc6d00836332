"""profile-server's file in the report (report/server_profile.py's profile_panel), hand-computed, and the source
label of an SGLang profile named as speedup.profile."""

from __future__ import annotations

import json

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.report import server_profile
from dflash_eval.report import speedup as report_speedup
from dflash_eval.speedup import labels


def stats(median):
    return {"median": median, "ci95": [median - 1, median + 1], "min": median - 2, "max": median + 2, "n": 6}


def profile_file(tmp_path, **extra):
    """T_AR 10 ms; k 4 steps 25 ms (4 tokens each); served: 8 ms per token, 20 ms per step, 2.5 tokens a step."""
    data = {
        "format": labels.SERVER_PROFILE_FORMAT,
        "engine": "sglang",
        "source": "test",
        "t_ar_ms": 10.0,
        "t_verify_ms": {"1": 10.0},
        "t_step_ms": {"8": 25.0},
        "block_size": 8,
        "t_step_from": "k 4",
        "settings": [
            {
                "name": "no-speculation",
                "SGLANG_SIMULATE_ACC_LEN": None,
                "requests": 6,
                "restart_s": 3.0,
                "decode_ms_per_token": stats(10.0),
            },
            {
                "name": "acc-len-4",
                "SGLANG_SIMULATE_ACC_LEN": 4.0,
                "requests": 6,
                "restart_s": 3.5,
                "decode_ms_per_token": stats(6.25),
                "ms_per_step": stats(25.0),
                "tokens_per_step": stats(4.0),
            },
            {
                "name": "served",
                "SGLANG_SIMULATE_ACC_LEN": None,
                "requests": 6,
                "restart_s": None,
                "decode_ms_per_token": stats(8.0),
                "ms_per_step": stats(20.0),
                "tokens_per_step": stats(2.5),
            },
        ],
        **extra,
    }
    path = tmp_path / "server_profile.json"
    path.write_text(json.dumps(data))
    return path


def test_the_panel_by_hand(tmp_path):
    """tau 3 on chain-B8: predicted 3 x 10 / 25 = 1.2x, 1.2 x 1000 / 10 = 120 tokens/s; the engine served
    1000 / 8 = 125 tokens/s, 10 / 8 = 1.25x over T_AR; 125 / 120 engine over predicted."""
    profile = server_profile.load_profile(profile_file(tmp_path))
    metrics = {
        "methods": {"chain-B8": {"tau_token_weighted": 3.0, "expected_speedup": None}},
        "speedup": {"available": False, "source": labels.NO_PROFILE, "why": "no target profile"},
    }
    panel = server_profile.profile_panel(
        profile, {("zlab", "gsm8k"): metrics}, {"served_drafter": "zlab", "datasets": ["gsm8k", "other"]}
    )
    e = panel["datasets"]["gsm8k"]
    assert e["predicted_speedup"] == pytest.approx(1.2) and e["predicted_tokens_per_s"] == pytest.approx(120.0)
    assert panel["engine"]["tokens_per_s"] == pytest.approx(125.0) and panel["engine"]["speedup"] == pytest.approx(1.25)
    assert e["engine_over_predicted"] == pytest.approx(125 / 120) and e["source"] == labels.USER_SGLANG
    assert e["our_estimate"] == {
        "method": "chain-B8",
        "available": False,
        "source": labels.NO_PROFILE,
        "why": "no target profile",
    }
    assert panel["datasets"]["other"]["predicted_speedup"] is None  # no evaluation of it: no tau, no guess
    page = "\n".join(server_profile.profile_lines(panel))
    assert "| acc-len-4 | 4 | 6 | 3.5 s | 6.25 ms (5.25..7.25) | 25 ms (24..26) | 4 |" in page
    assert "| served | – | 6 | restored by the pause |" in page
    assert (
        "| gsm8k | zlab | chain-B8 | 3.000 | 1.20× | 120 | 125 | 1.25× | 1.04× | none: no target profile | no profile |"
    ) in page
    assert server_profile.profile_lines(None) == []


def test_a_sampled_dataset_is_not_set_beside_the_greedy_engine_figure(tmp_path):
    """profile-server's requests are greedy, so the engine's served acceptance says nothing of a dataset sampled at
    T = 0.7: its prediction is shown, the engine / predicted ratio is not (the demo's demo-code-t07 gave 5.84x)."""
    profile = server_profile.load_profile(profile_file(tmp_path))
    metrics = {
        "methods": {"chain-B8": {"tau_token_weighted": 1.5, "expected_speedup": None}},
        "sampling": [{"temperature": 0.7, "top_p": 1.0}],
        "speedup": {"available": False, "source": labels.NO_PROFILE, "why": "no target profile"},
    }
    panel = server_profile.profile_panel(
        profile, {("zlab", "t07"): metrics}, {"served_drafter": "zlab", "datasets": ["t07"]}
    )
    e = panel["datasets"]["t07"]
    assert e["predicted_speedup"] == pytest.approx(0.6) and "engine_over_predicted" not in e
    assert e["engine_comparable"] == "no: the profile's requests are greedy, this dataset samples at T = 0.7"
    assert "| n/a (greedy profile, sampled dataset) |" in "\n".join(server_profile.profile_lines(panel))


def test_a_file_that_is_not_profile_server_s_is_refused_naming_it(tmp_path):
    with pytest.raises(DflashEvalError, match="not a dflash-eval profile-server file"):
        server_profile.load_profile(profile_file(tmp_path, format="something else"))
    bad = profile_file(tmp_path, t_ar_ms=-1)
    with pytest.raises(DflashEvalError, match="t_ar_ms"):
        server_profile.load_profile(bad)


def test_an_sglang_profile_as_speedup_profile_says_so(tmp_path):
    """The same file named as speedup.profile: chain-B8 priced from its whole step, labelled user profile (SGLang);
    a hand-written user profile keeps its old label."""
    path = profile_file(tmp_path)
    methods = {"chain-B8": {"block_size": 8, "tau_token_weighted": 3.0}}
    target, source, _stamp = report_speedup.load_target_profile(path, True)
    section = report_speedup.estimate(methods, target, source, True, None)
    assert section["source"] == labels.USER_SGLANG and methods["chain-B8"]["expected_speedup"] == pytest.approx(1.2)
    plain = tmp_path / "mine.json"
    plain.write_text(json.dumps({"t_ar_ms": 10.0, "t_verify_ms": {"1": 10.0}, "t_step_ms": {"8": 25.0}}))
    target, source, _stamp = report_speedup.load_target_profile(plain, True)
    section = report_speedup.estimate(methods, target, source, True, None)
    assert section["source"] == labels.USER
