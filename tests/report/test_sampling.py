"""The report at temperature > 0: the sampling each dataset was fetched with, tau against it, and the loud
line for a server whose sampled verification is not lossless."""

from __future__ import annotations

import json

from dflash_eval.report import markdown, trust

SAMPLED = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0}


def _row(dataset, tau, primary=True):
    return {"drafter": "d", "dataset": dataset, "primary": primary, "samples": 4, "tau_mean_of_samples": tau,
            "ci_low": tau - 0.1, "ci_high": tau + 0.1, "backend_mismatch_allowed": False, "method": "chain-B8"}


def _completions(path, sampling=None, warning=None):
    lines = []
    for k in range(2):
        record = {"id": f"p#s{k}", "messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1],
                  "completion_token_ids": [2, 3], "token_check": {"prompt_tokens_match": True,
                                                                  "completion_tokens_match": True}}
        if sampling is not None:
            record["sampling"] = {**sampling, "seed": 100 + k}
        if warning is not None:
            record["sampling_warning"] = warning
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fetch_entry_names_the_sampling_and_its_warning_and_greedy_has_neither(tmp_path):
    greedy = trust.fetch_entry(trust.read_completions(_completions(tmp_path / "g.jsonl")))
    assert "sampling" not in greedy and "sampling_warnings" not in greedy
    sampled = trust.fetch_entry(trust.read_completions(_completions(tmp_path / "s.jsonl", SAMPLED, "lossy: x")))
    assert sampled["sampling"] == [SAMPLED]  # one entry for both draws: the seed aside
    assert sampled["sampling_warnings"] == ["lossy: x"]
    found = markdown.trust_warnings({"fetch": {"s": sampled}, "caches": [], "online": {}, "server": {}})
    assert any(w.startswith("**Sampling not lossless**: s: lossy: x") for w in found)


def test_tau_against_temperature_table():
    panel = {"fetch": {"g": {"recorded": True}, "s": {"sampling": [{**SAMPLED, "top_k": 20}]}}}
    lines = markdown.temperature_lines([_row("g", 6.5), _row("s", 3.25), _row("s", 9.0, primary=False)], panel)
    text = "\n".join(lines)
    assert "| d | g | greedy (T 0) | 4 | 6.5" in text and "| d | s | T 0.7, top-p 0.95, top-k 20 | 4 | 3.25" in text
    assert "9.0" not in text  # only each drafter's own chain
    assert markdown.temperature_lines([_row("g", 6.5)], {"fetch": {"g": {"recorded": True}}}) == []  # all greedy
