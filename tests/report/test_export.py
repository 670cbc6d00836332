"""`dflash-eval export`: the speculation profile and the record, written from one evaluation's files, re-read and
checked against them."""

from __future__ import annotations

import argparse
import json

from dflash_eval import stats
from dflash_eval.evaluate.stage import samples_csv
from dflash_eval.io_utils import atomic_write_json, read_json_object, sha256_file
from dflash_eval.report import export
from tests.support.report_inputs import write_trust_inputs

STEPS = {str(i): [1 + i % 4, 4, 2] for i in range(10)}  # the fixtures' gsm8k completions hold ids 0..9
SETTINGS = {
    "context_buckets": [4],
    "bootstrap": 100,
    "seed": 3,
    "evaluate": {"drafter": "d", "seed": 3, "bootstrap": 100},
    "fetch": {"dataset": "gsm8k", "seed": 0, "max_samples": None},
}


def evaluation(root):
    """metrics.json and samples.csv of drafter d on gsm8k, as the evaluate stage writes them."""
    hidden, completions, _transitions = write_trust_inputs(root)
    lists = list(STEPS.values())
    chain = {
        "method": "chain-B4",
        "block_size": 4,
        **stats.tau_stats(lists),
        "ci95": stats.bootstrap_ci(lists, 100, 3),
        "acceptance_by_position": stats.acceptance_by_position(lists, 4),
        "expected_speedup": None,
    }
    metrics = {
        "drafter": "d",
        "dataset": "gsm8k",
        "block_size": 4,
        "layer_ids": [1, 3],
        "device": "cpu",
        "dtype": "float32",
        "verify": ["target_only"],
        "sampling": None,
        "stop_token_ids": [2],
        "checkpoint": {"path": "/ckpt/d", "layout": "hf", "sha256": "ab" * 32, "global_step": 5},
        "cache": {
            "dir": str(hidden[0]),
            "backend": "fla",
            "target_config_hash": "cd" * 32,
            "shards_verified": [{"file": "shard_00000.safetensors", "sha256": "5a" * 32}],
        },
        "chain": chain,
        "methods": {"chain-B4": chain},
    }
    directory = root / "eval" / "d" / "gsm8k"
    atomic_write_json(directory / "metrics.json", metrics)
    (directory / "samples.csv").write_text(
        samples_csv(
            [
                {
                    "id": i,
                    "method": "chain-B4",
                    "prompt_tokens": 2,
                    "completion_tokens": sum(s) + 1,
                    "steps": len(s),
                    "tokens": sum(s),
                    "tau": sum(s) / len(s),
                    "acceptance_lengths": " ".join(map(str, s)),
                }
                for i, s in STEPS.items()
            ]
        )
    )
    return directory, completions[0], hidden[0]


def run_export(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    export.add_arguments(parser)
    return export.run(parser.parse_args(argv))


def test_the_record_is_reread_and_checked_against_the_runs_own_outputs(tmp_path):
    directory, completions, hidden = evaluation(tmp_path)
    profile, record = directory / "speculation_profile.json", directory / "record.json"
    assert (
        run_export(
            "--settings",
            json.dumps(SETTINGS),
            "--metrics",
            str(directory / "metrics.json"),
            "--completions",
            str(completions),
            "--hidden",
            str(hidden),
            "--profile",
            str(profile),
            "--record",
            str(record),
        )
        == 0
    )
    kept = read_json_object(record)
    metrics = read_json_object(directory / "metrics.json")
    assert kept["numbers"]["target_only"]["chain-B4"]["tau_mean_of_samples"] == metrics["chain"]["tau_mean_of_samples"]
    assert kept["versions"]["extraction"]["versions"] == {"torch": "2.9.0", "fla": "0.6.0"}
    assert kept["versions"]["server"]["version"] == "0.5.23"
    assert kept["versions"]["exported_with"]["dflash_eval"]
    assert kept["settings"]["evaluate"] == SETTINGS["evaluate"] and kept["settings"]["fetch"] == SETTINGS["fetch"]
    assert kept["seeds"]["bootstrap_seed"] == 3 and kept["seeds"]["dataset_subset_seed"] == 0
    assert kept["inputs"]["completions"]["sha256"] == sha256_file(completions)
    assert kept["inputs"]["target"] == {"path": "/models/target", "config_hash": "cd" * 32}
    assert kept["outputs"]["speculation_profile"]["sha256"] == sha256_file(profile)
    assert export.check_record(record) == []
    assert run_export("--check", str(record)) == 0
    assert (
        read_json_object(profile)["profiles"]["chain-B4"]["marginal_accept_rates"]
        == metrics["chain"]["acceptance_by_position"]
    )


def test_a_changed_output_fails_the_check(tmp_path):
    directory, completions, hidden = evaluation(tmp_path)
    record = directory / "record.json"
    run_export(
        "--settings",
        json.dumps(SETTINGS),
        "--metrics",
        str(directory / "metrics.json"),
        "--completions",
        str(completions),
        "--hidden",
        str(hidden),
        "--profile",
        str(directory / "speculation_profile.json"),
        "--record",
        str(record),
    )
    metrics = read_json_object(directory / "metrics.json")
    metrics["methods"]["chain-B4"]["tau_mean_of_samples"] += 0.5
    atomic_write_json(directory / "metrics.json", metrics)
    problems = export.check_record(record)
    assert any("metrics.json: sha256 differs" in p for p in problems)
    assert any("target_only chain-B4's numbers differ" in p for p in problems)
    assert run_export("--check", str(record)) == 1
