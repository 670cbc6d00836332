"""`dflash-eval status`: the outputs older code made, named from their stamps in one line."""

from __future__ import annotations

import json

from dflash_eval import cli
from dflash_eval.provenance import identity, status


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_status_names_older_unstamped_and_current_outputs(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    assert status.line(results) == f"dflash-eval status: no stamped outputs under {results}/"
    _write(results / "hidden" / "d1" / "L1-2" / "manifest.json", {"code_identity": identity.stage_identity("extract")})
    _write(
        results / "profile" / "target" / "cuda0-bfloat16-fla.json",
        {"t_ar_ms": 1, "code_identity": identity.stage_identity("profile-target")},
    )
    _write(results / "eval" / "a" / "d1" / "metrics.json", {"code_identity": identity.stage_identity("evaluate")})
    _write(results / "trust.json", {"code_identity": identity.stage_identity("report")})
    assert status.line(results) == f"dflash-eval status: all 4 stamped outputs under {results}/ were made by this code"

    _write(results / "eval" / "b" / "d1" / "metrics.json", {"code_identity": "evaluate.v1.sha256:0000000000000000"})
    _write(results / "eval" / "c" / "d1" / "metrics.json", {"drafter": "c"})  # made before stamps
    _write(
        results / "profile" / "target" / "cuda0-bfloat16-fla.json",
        {"t_ar_ms": 1, "code_identity": "profile-target.v1.sha256:0000000000000000"},
    )
    line = status.line(results)
    assert line == (
        f"dflash-eval status: 3 of 6 stamped outputs were made by older code (profile-target: "
        f"{results}/profile/target/cuda0-bfloat16-fla.json; evaluate: {results}/eval/b/d1/"
        f"metrics.json; evaluate (unstamped): {results}/eval/c/d1/metrics.json)"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["status"]) == 0
    assert capsys.readouterr().out.strip() == line.replace(f"{results}/", "results/").replace(f"{results}", "results")


def test_completions_are_stamped_beside_them_by_the_engines_code_and_old_files_are_unstamped(tmp_path):
    """A completions file's stamp is its side file (the records keep their format); it is this code's when it names
    the identity of the engine it was planned for; a file from before stamps reads as unstamped."""
    results = tmp_path / "results"
    completions = results / "completions"
    _write(
        completions / "a.jsonl.stamp.json",
        {"code_identity": identity.stage_identity("fetch", "vllm"), "engine": "vllm"},
    )
    _write(
        completions / "b.jsonl.stamp.json",
        {"code_identity": identity.stage_identity("fetch", "sglang"), "engine": "vllm"},
    )
    _write(completions / "c.jsonl.stamp.json", {"code_identity": identity.stage_identity("fetch")})  # auto
    for name in "abcd":
        (completions / f"{name}.jsonl").write_text(json.dumps({"id": "p0"}) + "\n")  # d: made before stamps
    assert identity.stage_identity("fetch", "vllm") != identity.stage_identity("fetch", "sglang")
    assert status.line(results) == (
        f"dflash-eval status: 2 of 4 stamped outputs were made by older code (fetch: {completions}/b.jsonl; "
        f"fetch (unstamped): {completions}/d.jsonl)"
    )
