"""The cache <-> completions cross-check (issue 32): the real evaluate stage (CLI) on a real tiny cache; a cache
whose manifest was edited, or another completions file given by hand, writes no metrics, names the sample, the
cache and the file with the fix, and leaves what an earlier evaluation wrote as it was."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest

from dflash_eval import cli
from dflash_eval.cache.completions_check import IDENTITY_KEY, token_identity
from dflash_eval.extract import stage as extract_stage
from tests.support.extract_runs import evaluate_settings
from tests.support.tiny import tiny_drafter, tiny_target

LAYERS = [0, 2]


def test_a_token_identity_is_the_sha256_of_both_id_lists_and_sees_the_prompt_boundary():
    record = {"prompt_token_ids": [1, 2], "completion_token_ids": [3]}
    assert token_identity(record) == hashlib.sha256(b"1,2|3").hexdigest()
    assert token_identity({"prompt_token_ids": [1], "completion_token_ids": [2, 3]}) != token_identity(record)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("crosscheck")
    tiny_target().save_pretrained(root / "target")
    tiny_drafter(LAYERS).save_pretrained(root / "drafter", safe_serialization=True)
    rng = random.Random(0)
    records = []
    for index in range(3):
        ids = [rng.randrange(2, 290) for _ in range(10)]
        records.append(
            {
                "id": f"s{index}",
                "prompt_token_ids": ids[:3],
                "completion_token_ids": ids[3:],
                "request": {"max_tokens": 7},
                "completion_ids_source": "server",
                "token_check": {},
            }
        )
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    extract_stage.extract(
        {
            "dataset": "toy",
            "layer_ids": LAYERS,
            "shard_tokens": 24,
            "store_argmax": True,
            "strict_tokens": False,
            "server": None,
            "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
        },
        root / "c.jsonl",
        root / "hidden",
    )
    settings = evaluate_settings(
        root,
        max_tokens=7,
        allow_backend_mismatch=False,
        block_sizes=[],
        ddtree_budgets=[],
        topk=[],
    )
    return root, records, settings


def _evaluate(settings: dict, hidden: Path, completions: Path, out: Path) -> tuple[int, str]:
    log = out / "evaluate.log"
    log.unlink(missing_ok=True)
    code = cli.main(
        [
            "--log",
            str(log),
            "evaluate",
            "--settings",
            json.dumps(settings),
            "--hidden",
            str(hidden),
            "--completions",
            str(completions),
            "--metrics",
            str(out / "metrics.json"),
            "--samples",
            str(out / "samples.csv"),
        ]
    )
    return code, log.read_text() if log.exists() else ""


def _written(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("metrics.json", "samples.csv")}


@pytest.fixture
def evaluated(project, tmp_path):
    """A copy of the cache, and the metrics an evaluation of it already wrote (which a refused run must keep)."""
    root, records, settings = project
    hidden = tmp_path / "hidden"
    shutil.copytree(root / "hidden", hidden)
    code, log = _evaluate(settings, hidden, root / "c.jsonl", tmp_path)
    assert code == 0, log
    return hidden, _written(tmp_path)


def test_the_manifest_records_each_samples_token_identity(project):
    root, records, _ = project
    held = json.loads((root / "hidden" / "manifest.json").read_text())["completions"]
    assert held["sha256"] == hashlib.sha256((root / "c.jsonl").read_bytes()).hexdigest()
    assert held[IDENTITY_KEY] == {r["id"]: token_identity(r) for r in records}


def test_a_samples_length_edited_in_the_cache_is_refused_naming_it(project, evaluated, tmp_path):
    root, _, settings = project
    hidden, before = evaluated
    manifest = json.loads((hidden / "manifest.json").read_text())
    manifest["samples"][1]["length"] -= 2  # still inside its shard: the manifest's own checks pass
    (hidden / "manifest.json").write_text(json.dumps(manifest))
    code, log = _evaluate(settings, hidden, root / "c.jsonl", tmp_path)
    assert code == 2, log
    assert (
        f"{hidden / 'manifest.json'} against {root / 'c.jsonl'}: 1 sample(s) differ in length: 's1' (8 tokens, "
        "3 of prompt, in the cache; 10 and 3 in the completions)" in log
    )
    assert f"snakemake --forcerun {hidden}" in log and "Traceback" not in log
    assert _written(tmp_path) == before


def test_another_completions_file_is_refused_naming_the_sample_and_both_files(project, evaluated, tmp_path):
    root, records, settings = project
    hidden, before = evaluated
    other = [dict(r) for r in records]
    other[2]["completion_token_ids"] = [*other[2]["completion_token_ids"][:-1], 5]  # same lengths, one token
    given = tmp_path / "other.jsonl"
    given.write_text("".join(json.dumps(r) + "\n" for r in other))
    code, log = _evaluate(settings, hidden, given, tmp_path)
    assert code == 2, log
    assert (
        f"{hidden / 'manifest.json'} against {given}: not the completions the cache was extracted from "
        "(1 sample(s) with other token ids: s2)" in log
    )
    assert f"the completions file the cache was built from ({root / 'c.jsonl'})" in log
    assert _written(tmp_path) == before

    given.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))  # a sample short
    code, log = _evaluate(settings, hidden, given, tmp_path)
    assert code == 2 and "1 cached sample(s) not in the completions: s2" in log
    assert _written(tmp_path) == before


def test_other_bytes_with_the_same_tokens_evaluate_as_before(project, evaluated, tmp_path):
    """A rewritten file (another order, another field) is still the cache's completions: same numbers."""
    root, records, settings = project
    hidden, before = evaluated
    given = tmp_path / "rewritten.jsonl"
    given.write_text("".join(json.dumps({**r, "note": 1}) + "\n" for r in reversed(records)))
    code, log = _evaluate(settings, hidden, given, tmp_path)
    assert code == 0, log
    assert "every sample's token ids are the same" in log
    assert json.loads(_written(tmp_path)["metrics.json"])["methods"] == json.loads(before["metrics.json"])["methods"]


def test_an_old_cache_without_identities_passes_with_its_own_file_and_is_refused_with_another(
    project, evaluated, tmp_path
):
    root, records, settings = project
    hidden, before = evaluated
    manifest = json.loads((hidden / "manifest.json").read_text())
    del manifest["completions"][IDENTITY_KEY]
    (hidden / "manifest.json").write_text(json.dumps(manifest))
    code, log = _evaluate(settings, hidden, root / "c.jsonl", tmp_path)
    assert code == 0, log  # right caches need no rebuild
    assert _written(tmp_path) == before
    given = tmp_path / "rewritten.jsonl"
    given.write_text("".join(json.dumps({**r, "note": 1}) + "\n" for r in records))
    code, log = _evaluate(settings, hidden, given, tmp_path)
    assert code == 2, log
    assert f"the cache was extracted from {str(root / 'c.jsonl')!r}" in log
    assert f"predates the per-sample record ({IDENTITY_KEY})" in log and f"--completions {given}" in log
    assert _written(tmp_path) == before


def test_the_same_completions_in_another_order_give_the_same_numbers(project, evaluated, tmp_path):
    """Issue 32: a reordered prompt file moved the CIs (the bootstrap resamples by position): the evaluation goes by
    sample id, so a cache extracted from the completions in another order gives the same metrics and samples.csv."""
    root, records, settings = project
    _, before = evaluated
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(json.dumps(r) + "\n" for r in [records[2], records[0], records[1]]))
    extract_stage.extract(
        {
            "dataset": "toy",
            "layer_ids": LAYERS,
            "shard_tokens": 24,
            "store_argmax": True,
            "strict_tokens": False,
            "server": None,
            "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
        },
        reordered,
        tmp_path / "hidden-reordered",
    )
    assert [s["id"] for s in json.loads((tmp_path / "hidden-reordered" / "manifest.json").read_text())["samples"]] == [
        "s2",
        "s0",
        "s1",
    ]
    out = tmp_path / "reordered-eval"
    out.mkdir()
    code, log = _evaluate({**settings, "bootstrap": 200}, tmp_path / "hidden-reordered", reordered, out)
    assert code == 0, log
    again = tmp_path / "again"
    again.mkdir()
    code, log = _evaluate({**settings, "bootstrap": 200}, root / "hidden", root / "c.jsonl", again)
    assert code == 0, log
    assert _written(out)["samples.csv"] == _written(again)["samples.csv"]
    assert (
        json.loads(_written(out)["metrics.json"])["methods"] == json.loads(_written(again)["metrics.json"])["methods"]
    )
