"""The engine's measured step time beside the estimate (report/engine_timing.py), hand-computed."""

from __future__ import annotations

import json

import pytest

from dflash_eval.report import engine_timing
from dflash_eval.speedup import labels

SPEC = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 8}


def record(e2e, steps, tokens, first=None, concurrency=1, **extra):
    engine = {"meta_info": e2e is not None, "spec_verify_ct": steps, "completion_tokens": tokens, **extra}
    if e2e is not None:
        engine["e2e_latency"] = e2e
    if first is not None:
        engine["first_token_latency"] = first
    return {
        "engine": engine,
        "client_timing": {"wall_s": 1.0, "concurrency": concurrency},
        "server": {"speculative": SPEC},
    }


def metrics(verify: dict, speedup: float | None, source: str = labels.USER) -> dict:
    return {
        "speedup": {
            "available": True,
            "source": source,
            "target_source": "user profile p.json",
            "verify": {"chain-B8": verify},
        },
        "methods": {"chain-B8": {"expected_speedup": speedup}},
    }


def test_step_time_and_tokens_per_second_by_hand():
    """0.5 s / 10 steps / 31 tokens and 0.3 s / 6 steps / 19 tokens: 800 ms over 16 steps = 50 ms a step,
    50 tokens / 0.8 s = 62.5 tokens/s; first tokens at 0.1 and 0.05 s: decode 0.65 s, 40.625 ms a step,
    48 tokens after the first ones / 0.65 s. A record without e2e_latency is left out and counted."""
    out = engine_timing.measured([record(0.5, 10, 31, 0.1), record(0.3, 6, 19, 0.05), record(None, 4, 9)])
    assert out["recorded"] and out["requests"] == 2 and out["requests_without_timing"] == 1
    assert out["ms_per_step"] == pytest.approx(50.0) and out["tokens_per_s"] == pytest.approx(62.5)
    assert out["decode_ms_per_step"] == pytest.approx(40.625)
    assert out["decode_tokens_per_s"] == pytest.approx(48 / 0.65)
    assert out["block_sizes"] == [8] and out["concurrency"] == [1] and "batched" not in out
    # one request without first_token_latency: no decode-only figure (never a guess)
    partial = engine_timing.measured([record(0.5, 10, 31, 0.1), record(0.3, 6, 19)])
    assert "decode_ms_per_step" not in partial and partial["ms_per_step"] == pytest.approx(50.0)
    batched = engine_timing.measured([record(0.5, 10, 31, concurrency=4)])
    assert "4 requests in flight" in batched["batched"]
    assert engine_timing.measured([record(None, 3, 9)])["recorded"] is False


@pytest.mark.parametrize(
    ("verify", "t_step", "source", "label"),
    [
        (
            {"tokens": 8, "t_verify_ms": 30.0, "t_draft_ms": 5.0, "block_size": 8},
            35.0,
            labels.MEASURED,
            "HF profile (measured by us)",
        ),
        ({"tokens": 8, "t_step_ms": 40.0, "block_size": 8}, 40.0, labels.USER, "user profile"),
    ],
)
def test_the_estimate_beside_it_and_their_ratio(verify, t_step, source, label):
    entry = engine_timing.entry([record(0.5, 10, 31)], metrics(verify, 2.5, source), "zlab")
    assert entry["estimate"]["t_step_ms"] == t_step and entry["estimate"]["source"] == label
    assert entry["estimate"]["expected_speedup"] == 2.5
    assert entry["engine_over_estimate"] == pytest.approx(50.0 / t_step)
    page = "\n".join(engine_timing.lines({"gsm8k": entry}))
    assert "| gsm8k | zlab | chain-B8 | 1 | 1 | 50 ms | – | 62 |" in page
    assert f"{t_step:.3g} ms" in page and "2.50×" in page and label in page


def test_no_estimate_says_why_and_no_timing_shows_nothing():
    no_profile = {"speedup": {"available": False, "why": "no target profile (x; y)", "source": labels.NO_PROFILE}}
    entry = engine_timing.entry([record(0.5, 10, 31)], no_profile, "zlab")
    assert entry["estimate"]["available"] is False and "engine_over_estimate" not in entry
    assert "none: no target profile" in "\n".join(engine_timing.lines({"d": entry}))
    assert engine_timing.lines({"d": engine_timing.entry([record(None, 3, 9)], no_profile, "zlab")}) == []


def test_the_panel_reads_the_completions_files(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    base = {"id": "a", "prompt_token_ids": [1], "completion_token_ids": [2, 3]}
    path.write_text("".join(json.dumps({**base, "id": i, **record(0.2, 2, 5)}) + "\n" for i in ("a", "b")))
    out = engine_timing.panel(
        {("zlab", "gsm8k"): metrics({"tokens": 8, "t_step_ms": 40.0}, 2.0)},
        {"datasets": ["gsm8k"], "served_drafter": "zlab"},
        [path, tmp_path / "absent.jsonl"],
    )
    assert set(out) == {"gsm8k"} and out["gsm8k"]["engine"]["ms_per_step"] == pytest.approx(100.0)
    assert out["gsm8k"]["engine_over_estimate"] == pytest.approx(2.5)
