"""The report at temperature > 0: the sampling each dataset was fetched with, tau against it, and the loud
line for a server whose sampled verification is not lossless."""

from __future__ import annotations

import json

from dflash_eval.report import diagnostics_section, markdown, tau_section, trust, trust_section

SAMPLED = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0}


def _row(dataset, tau, primary=True):
    return {
        "drafter": "d",
        "dataset": dataset,
        "primary": primary,
        "samples": 4,
        "tau_mean_of_samples": tau,
        "ci_low": tau - 0.1,
        "ci_high": tau + 0.1,
        "backend_mismatch_allowed": False,
        "method": "chain-B8",
    }


def _completions(path, sampling=None, warning=None):
    lines = []
    for k in range(2):
        record = {
            "id": f"p#s{k}",
            "messages": [{"role": "user", "content": "x"}],
            "prompt_token_ids": [1],
            "completion_token_ids": [2, 3],
            "token_check": {"prompt_tokens_match": True, "completion_tokens_match": True},
        }
        if sampling is not None:
            record["sampling"] = {**sampling, "seed": 100 + k}
        if warning is not None:
            record["sampling_warning"] = warning
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fetch_entry_names_the_sampling_and_its_warning_and_greedy_has_neither(tmp_path):
    greedy = trust.fetch_entry(trust.scan_completions(_completions(tmp_path / "g.jsonl")))
    assert "sampling" not in greedy and "sampling_warnings" not in greedy
    sampled = trust.fetch_entry(trust.scan_completions(_completions(tmp_path / "s.jsonl", SAMPLED, "lossy: x")))
    assert sampled["sampling"] == [SAMPLED]  # one entry for both draws: the seed aside
    assert sampled["sampling_warnings"] == ["lossy: x"]
    found = trust_section.trust_warnings({"fetch": {"s": sampled}, "caches": [], "online": {}, "server": {}})
    assert any(w.startswith("**Sampling not lossless**: s: lossy: x") for w in found)


def test_tau_against_temperature_table():
    panel = {"fetch": {"g": {"recorded": True}, "s": {"sampling": [{**SAMPLED, "top_k": 20}]}}}
    lines = tau_section.temperature_lines([_row("g", 6.5), _row("s", 3.25), _row("s", 9.0, primary=False)], panel)
    text = "\n".join(lines)
    assert "| d | g | greedy (T 0) | 4 | 6.5" in text and "| d | s | T 0.7, top-p 0.95, top-k 20 | 4 | 3.25" in text
    assert "9.0" not in text  # only each drafter's own chain
    assert tau_section.temperature_lines([_row("g", 6.5)], {"fetch": {"g": {"recorded": True}}}) == []  # all greedy


def _sampled_evaluations(tmp_path):
    """step-1000 on gsm8k sampled (T 0.7, top-p 0.8, top-k 20) with a rejection section; the rest greedy."""
    from dflash_eval.report import metrics_files
    from tests.support.report_inputs import metrics_dict, write_metrics

    greedy = [metrics_files.read_metrics(path) for path in write_metrics(tmp_path)]
    sampled = metrics_dict("step-1000", "gsm8k")
    sampled["sampling"] = [{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}]
    sampled["rejection"] = {
        "scheme": "rejection",
        "outside_support": {"samples": 1, "samples_scored": 10, "share_of_samples": 0.1, "tokens": 1},
        "methods": {
            "chain-B4": {
                "method": "chain-B4",
                "scheme": "rejection",
                "block_size": 4,
                "tau_mean_of_samples": 2.5,
                "tau_token_weighted": 2.6,
                "ci95": {"tau_mean_of_samples": [2.2, 2.8], "tau_token_weighted": [2.3, 2.9]},
                "samples": 10,
                "expected_steps": 160.4,
                "tokens": 417,
            }
        },
    }
    return [metrics_files.Evaluation(greedy[0].path, sampled), *greedy[1:]]


def test_every_number_names_its_scheme_and_sampling(tmp_path):
    """The introduction says which scheme each table is under once a dataset samples (it said "greedy verification
    against the target's own greedy completions" for all), a sampled column names its sampling and scheme, a DDTree
    column at T > 0 is marked hypothetical (SGLang 0.5.23 has no DDTree), and the rejection table counts samples."""
    from dflash_eval.report import summary
    from tests.support.report_inputs import SETTINGS

    evaluations = _sampled_evaluations(tmp_path)
    rows = summary.summary_rows(evaluations, SETTINGS)
    served = [r for r in rows if r["scheme"] == "target_only"]
    intro = markdown.intro(served, evaluations)
    assert "**target_only** verification, SGLang 0.5.23's DFlash scheme" in intro
    assert "greedy verification against the target's own greedy completions" not in intro
    assert "dflash_generate's scheme (verify: rejection)" in intro and "DDTree at T > 0 is hypothetical" in intro
    header = tau_section.tau_table(served, SETTINGS, "tau_mean_of_samples", "ci_low", "ci_high")[0]
    assert "gsm8k (T 0.7, top-p 0.8, top-k 20, target_only)<br>chain-B4 |" in header
    assert "gsm8k (T 0.7, top-p 0.8, top-k 20, target_only)<br>ddtree-8 † |" in header
    assert "humaneval<br>ddtree-8 |" in header  # greedy: as before
    table = "\n".join(tau_section.rejection_table(rows, SETTINGS))
    assert "| tau target_only | samples | tau rejection (expected) | 95% CI | samples | outside support |" in table
    assert "| T 0.7, top-p 0.8, top-k 20 |" in table and "| 2.20..2.80 | 10 | 1 (10.0%) |" in table
    warned = [w for w in diagnostics_section.evaluation_warnings(evaluations) if "outside dflash's support" in w]
    assert warned == [
        "**Tokens outside dflash's support**: step-1000 on gsm8k: 1 of 10 samples (10.0%; 1 tokens) hold "
        "a verified token dflash's top-k/top-p filter excludes, scored as a rejection at its anchor: their "
        "expected tau under `rejection` is a lower bound."
    ]
    greedy = [e for e in evaluations[1:]]
    assert markdown.intro(summary.summary_rows(greedy, SETTINGS), greedy) == markdown.INTRO  # greedy-only: unchanged
