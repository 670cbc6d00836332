"""Several checkpoints in one evaluate process (evaluate/several.py) and the result store behind it
(evaluate/result_store.py): the device claimed once, restore only on an equal key, clear errors. The real
evaluations under Snakemake are tests/workflow/test_grouped_evaluation.py."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import several, stage
from dflash_eval.evaluate.result_store import ResultStore, key_of, key_parts


def inputs(root: Path) -> dict:
    """A checkpoint file, a target directory, a cache folder with a manifest and a shard, a completions file."""
    (root / "target").mkdir(parents=True)
    (root / "target" / "config.json").write_text("{}")
    (root / "ck.safetensors").write_bytes(b"weights-1")
    (root / "hidden").mkdir()
    (root / "hidden" / "manifest.json").write_text('{"shards": []}')
    (root / "hidden" / "shard-0.safetensors").write_bytes(b"states")
    (root / "c.jsonl").write_text('{"id": "s0"}\n')
    return {
        "drafter": "a",
        "dataset": "d",
        "checkpoint": {"path": str(root / "ck.safetensors"), "config": None},
        "target": {"path": str(root / "target")},
        "speedup": {},
        "device": "cpu",
    }


def member(settings: dict, out: Path) -> str:
    return json.dumps({"settings": settings, "metrics": str(out / "metrics.json"), "samples": str(out / "samples.csv")})


def test_the_key_changes_with_each_input_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the fingerprint cache (.snakemake/) of this test only
    settings = inputs(tmp_path)
    hidden, completions = tmp_path / "hidden", tmp_path / "c.jsonl"
    first = key_of(key_parts(settings, hidden, completions))
    assert key_of(key_parts(settings, hidden, completions)) == first
    changes = [
        lambda: (tmp_path / "ck.safetensors").write_bytes(b"weights-2"),
        lambda: (tmp_path / "target" / "config.json").write_text('{"x": 1}'),
        lambda: (hidden / "manifest.json").write_text('{"shards": [1]}'),
        lambda: os.utime(hidden / "shard-0.safetensors", ns=(1, 1)),  # a shard rewritten since
        lambda: completions.write_text('{"id": "s1"}\n'),
    ]
    seen = {first}
    for change in changes:
        change()
        key = key_of(key_parts(settings, hidden, completions))
        assert key not in seen
        seen.add(key)
    assert key_of(key_parts({**settings, "bootstrap": 5}, hidden, completions)) not in seen


def test_the_store_restores_only_an_equal_key_and_replaces_an_older_entry(tmp_path):
    store, out = ResultStore(tmp_path / "store"), tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text("m1")
    (out / "samples.csv").write_text("s1")
    files = {"metrics.json": out / "metrics.json", "samples.csv": out / "samples.csv"}
    store.save("a", "d", "k1", {"p": 1}, files)
    restored = {"metrics.json": tmp_path / "r" / "metrics.json", "samples.csv": tmp_path / "r" / "samples.csv"}
    assert not store.restore("a", "d", "k2", restored) and not restored["metrics.json"].exists()
    assert not store.restore("b", "d", "k1", restored)
    assert store.restore("a", "d", "k1", restored)
    assert restored["metrics.json"].read_text() == "m1" and restored["samples.csv"].read_text() == "s1"
    (out / "metrics.json").write_text("m2")
    store.save("a", "d", "k2", {"p": 2}, files)
    assert not store.restore("a", "d", "k1", restored)
    assert store.restore("a", "d", "k2", restored) and restored["metrics.json"].read_text() == "m2"
    assert sorted(p.name for p in (tmp_path / "store" / "a").iterdir()) == ["d"]  # no temporary folder left
    (tmp_path / "store" / "a" / "d" / "key.json").write_text("{torn")
    assert not store.restore("a", "d", "k2", restored)  # a damaged entry is an evaluation, not an error


def _args(tmp_path: Path, members: list[str], store: Path | None) -> argparse.Namespace:
    return argparse.Namespace(
        member=members,
        settings=None,
        metrics=None,
        samples=None,
        runtime=None,
        hidden=str(tmp_path / "hidden"),
        completions=str(tmp_path / "c.jsonl"),
        store=str(store) if store else None,
        placement=None,
    )


def test_one_claim_per_process_and_a_second_run_restores_every_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = inputs(tmp_path)
    claims, evaluated = [], []

    def claim(settings, placement, job):
        claims.append(job)
        return "the claimed device"

    def evaluate(settings, hidden, completions, placement=None, device=None):
        assert device == "the claimed device"  # never a second claim inside the evaluation
        evaluated.append(settings["drafter"])
        from dflash_eval.provenance.fingerprint import checkpoint_sha256

        metrics = {
            "drafter": settings["drafter"],
            "dataset": "d",
            "methods": {},
            "checkpoint": {"sha256": checkpoint_sha256(settings["checkpoint"]["path"])},
        }
        return metrics, [{"id": "s0", "method": "chain-B4", "steps": 1, "tokens": 2, "tau": 2.0}]

    monkeypatch.setattr(stage, "claim_settings_device", claim)
    monkeypatch.setattr(stage, "run_evaluation", evaluate)
    members = [member({**settings, "drafter": name}, tmp_path / "out" / name) for name in ("a", "b", "c")]
    assert several.run_several(_args(tmp_path, members, tmp_path / "store")) == 0
    assert claims == ["evaluate a, b, c d"] and evaluated == ["a", "b", "c"]
    written = {p: p.read_bytes() for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()}
    for path in written:
        path.unlink()  # what Snakemake does before it reruns the job
    assert several.run_several(_args(tmp_path, members, tmp_path / "store")) == 0
    assert evaluated == ["a", "b", "c"], "nothing changed: all three restored"
    assert {p: p.read_bytes() for p in written} == written
    (tmp_path / "ck.safetensors").write_bytes(b"weights-2")  # the checkpoint all three name (a test's shortcut)
    assert several.run_several(_args(tmp_path, members, tmp_path / "store")) == 0
    assert evaluated == ["a", "b", "c"] * 2
    assert len(claims) == 3  # one per process


@pytest.mark.parametrize(
    "members, message",
    [
        (["{not json"], "--member 1: not valid JSON"),
        (['{"settings": {}}'], "--member 1: needs the keys settings, metrics and samples (missing metrics, samples)"),
    ],
)
def test_a_malformed_member_is_named(tmp_path, members, message):
    with pytest.raises(DflashEvalError, match=message.replace("(", r"\(").replace(")", r"\)")):
        several.parse_members(members)


def test_members_of_two_devices_or_one_output_are_refused(tmp_path):
    settings = {"drafter": "a", "dataset": "d", "checkpoint": {"path": "ck"}, "target": {"path": "t"}}
    out = tmp_path / "o"
    with pytest.raises(DflashEvalError, match="share its device, but they ask for cpu, cuda"):
        several.parse_members([member(settings, out / "a"), member({**settings, "device": "cuda"}, out / "b")])
    with pytest.raises(DflashEvalError, match="two checkpoints would write"):
        several.parse_members([member(settings, out), member({**settings, "drafter": "b"}, out)])


def test_the_command_line_says_which_arguments_go_together(capsys):
    from dflash_eval.cli import main

    base = ["evaluate", "--hidden", "h", "--completions", "c"]
    assert main([*base, "--settings", "{}"]) == 2
    assert "give --metrics and --samples (one checkpoint), or --member" in capsys.readouterr().err
    assert main([*base, "--member", "{}", "--metrics", "m.json"]) == 2
    assert "--member replaces --settings, --metrics and --samples" in capsys.readouterr().err
