"""Declared code identities: every import declared, one hash rule, docstrings and comments not counted."""

from __future__ import annotations

import ast
import shutil

import pytest

from dflash_eval.provenance import code_version, identity


def covered(stage: str) -> set[str]:
    declared = identity.STAGES[stage]
    return {m for name in declared.decides + declared.runs for m in identity.package_modules(name)}


@pytest.mark.parametrize("stage", sorted(identity.STAGES))
def test_every_module_a_stage_imports_is_declared_as_deciding_its_outputs_or_as_how_it_runs(stage):
    """The lists cannot go stale: a new `dflash_eval` import of a stage fails here until it is declared."""
    undeclared = sorted(set(code_version.stage_modules(stage)) - covered(stage))
    assert not undeclared, (
        f"{stage} imports {undeclared}: add each to STAGES[{stage!r}] in "
        "provenance/identity.py, in `decides` if its code computes the stage's files, else `runs`"
    )


def test_the_import_check_fails_on_an_undeclared_import(tmp_path, monkeypatch):
    """The check above can fail: a stage that starts importing a module nobody declared is caught."""
    copy = tmp_path / "dflash_eval"
    shutil.copytree(code_version.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "report" / "new_table.py").write_text("X = 1\n")
    stage = copy / "report" / "stage.py"
    stage.write_text(
        stage.read_text() + "\nfrom dflash_eval.stats import median_ci  # noqa\n"
        "from dflash_eval.evaluate import trajectory  # noqa\n"
    )
    monkeypatch.setattr(code_version, "PACKAGE_DIR", copy)
    code_version.stage_modules.cache_clear()
    try:
        assert "evaluate.trajectory" in set(code_version.stage_modules("report")) - covered("report")
    finally:
        monkeypatch.undo()
        code_version.stage_modules.cache_clear()


def test_every_declared_module_exists():
    for stage, declared in identity.STAGES.items():
        for name in declared.decides + declared.runs:
            assert identity.package_modules(name), (stage, name)
    with pytest.raises(KeyError, match="no such module"):
        identity.package_modules("evaluate.gone")


def test_the_server_the_cli_and_config_decide_no_output():
    """How a stage runs (the server's lifecycle, the settings' plumbing) is never part of what decides its files."""
    for stage, declared in identity.STAGES.items():
        decided = {m for name in declared.decides for m in identity.package_modules(name)}
        assert not {m for m in decided if m.startswith("server.") or m in ("config", "cli", "commands")}, stage


def _package_copy(tmp_path, monkeypatch):
    copy = tmp_path / "dflash_eval"
    shutil.copytree(identity.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "PACKAGE_DIR", copy)
    monkeypatch.setattr(
        identity, "_CODE_DIGESTS", identity.FingerprintCache(tmp_path / "code.json", digest=identity._statement_digests)
    )
    return copy


def _identity(stage: str) -> str:
    identity.stage_identity.cache_clear()
    return identity.stage_identity(stage)


def test_docstrings_comments_and_formatting_do_not_change_an_identity_and_code_does(tmp_path, monkeypatch):
    copy = _package_copy(tmp_path, monkeypatch)
    try:
        before = _identity("evaluate")
        acceptance = copy / "evaluate" / "acceptance.py"
        text = acceptance.read_text()
        edited = text.replace('"""', '"""A new first sentence. ', 1) + "\n\n# a comment\n\n"
        acceptance.write_text(edited)
        assert _identity("evaluate") == before
        acceptance.write_text(edited + "EDITED = 1\n")
        assert _identity("evaluate") != before
        acceptance.write_text(text)
        assert _identity("evaluate") == before
        config = copy / "config.py"  # settings are params, not code
        config.write_text(config.read_text() + "\nEDITED = 1\n")
        assert _identity("evaluate") == before and _identity("report") == _identity("report")
    finally:
        monkeypatch.undo()
        identity.stage_identity.cache_clear()


def test_the_output_version_changes_the_identity(monkeypatch):
    before = _identity("report")
    declared = identity.STAGES["report"]
    monkeypatch.setitem(
        identity.STAGES, "report", identity.StageCode(declared.decides, declared.runs, declared.version + 1)
    )
    try:
        after = _identity("report")
        assert after != before and after.startswith(f"report.v{declared.version + 1}.sha256:")
    finally:
        monkeypatch.undo()
        identity.stage_identity.cache_clear()


def test_one_hash_rule_for_the_states_the_estimate_and_the_stages():
    """cache/reuse.py's state key and speedup/validation.py's record hash are identity's, by the same rule."""
    from dflash_eval.speedup import validation

    assert identity.state_code_hash() == identity.modules_hash(identity.STATE_CODE)
    assert validation.code_hash() == identity.modules_hash(identity.ESTIMATE_CODE)
    assert set(identity.STATE_CODE) <= set(identity.STAGES["extract"].decides)
    assert identity.module_code("speedup") == "pass"  # the package __init__ is its docstring alone


def _declare(monkeypatch, stage: str, old: str, new: str) -> None:
    declared = identity.STAGES[stage]
    decides = tuple(new if name == old else name for name in declared.decides)
    monkeypatch.setitem(identity.STAGES, stage, identity.StageCode(decides, declared.runs, declared.version))


def test_moving_a_function_between_two_declared_modules_keeps_the_identity(tmp_path, monkeypatch):
    """The identity is over the stage's code, not its file layout: a function moved from one declared module to
    another (its callers importing it from the new one) changes nothing; editing it afterwards does."""
    copy = _package_copy(tmp_path, monkeypatch)
    try:
        before = _identity("evaluate")
        blocks, acceptance = copy / "evaluate" / "blocks.py", copy / "evaluate" / "acceptance.py"
        moved = "\n\ndef moved_helper(x: int) -> int:\n    return x + 1\n"
        blocks.write_text(blocks.read_text() + moved)
        with_helper = _identity("evaluate")
        assert with_helper != before, "new code changes it"
        blocks.write_text(blocks.read_text().replace(moved, ""))
        acceptance.write_text(acceptance.read_text() + "\nimport math\n" + moved)
        assert _identity("evaluate") == with_helper, "moved (and an import both modules make): the same"
        acceptance.write_text(acceptance.read_text().replace("return x + 1", "return x + 2"))
        assert _identity("evaluate") != with_helper
    finally:
        monkeypatch.undo()
        identity.stage_identity.cache_clear()


def test_renaming_or_splitting_a_declared_module_keeps_the_identity(tmp_path, monkeypatch):
    copy = _package_copy(tmp_path, monkeypatch)
    try:
        before = _identity("evaluate")
        old = copy / "evaluate" / "packed.py"  # its importers import its names (`from ... import`), as a rename keeps
        text = old.read_text()
        (copy / "evaluate" / "packed_rows.py").write_text(text)
        old.unlink()
        renamed = 0
        for caller in copy.rglob("*.py"):
            if "evaluate.packed import" in caller.read_text():
                caller.write_text(caller.read_text().replace("evaluate.packed import", "evaluate.packed_rows import"))
                renamed += 1
            if "evaluate import packed\n" in caller.read_text():  # a module import keeps its name in the code
                caller.write_text(
                    caller.read_text().replace("evaluate import packed\n", "evaluate import packed_rows as packed\n")
                )
                renamed += 1
        assert renamed >= 3
        _declare(monkeypatch, "evaluate", "evaluate.packed", "evaluate.packed_rows")
        assert _identity("evaluate") == before, "renamed, with its declaration and its importers"

        tree = ast.parse(text)
        defs = [i for i, node in enumerate(tree.body) if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        assert len(defs) >= 2, "a module with two definitions to split"
        lines = text.splitlines(keepends=True)
        cut = tree.body[defs[-1]].lineno - 1 - len(tree.body[defs[-1]].decorator_list)
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        head = "\n".join(ast.get_source_segment(text, node) for node in imports)
        (copy / "evaluate" / "packed_rows.py").write_text("".join(lines[:cut]))
        (copy / "evaluate" / "packed_tail.py").write_text(head + "\n\n" + "".join(lines[cut:]))
        declared = identity.STAGES["evaluate"]
        monkeypatch.setitem(
            identity.STAGES,
            "evaluate",
            identity.StageCode((*declared.decides, "evaluate.packed_tail"), declared.runs, declared.version),
        )
        assert _identity("evaluate") == before, "split in two, each importing what it needs"
    finally:
        monkeypatch.undo()
        identity.stage_identity.cache_clear()


def test_a_dflash_eval_import_counts_by_the_names_it_binds_inside_a_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from dflash_eval.a import f\nimport torch\n\ndef g():\n    from dflash_eval.b import h\n    return h\n"
    )
    moved = tmp_path / "n.py"
    moved.write_text(
        "from dflash_eval.c import f\nimport torch\n\ndef g():\n    from dflash_eval.d import h\n    return h\n"
    )
    assert identity._statements(str(path)) == identity._statements(str(moved))
    assert "import torch" in identity._statements(str(path))


def test_each_files_statement_digests_are_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    """Parsing every declared module takes seconds on a slow machine: a second identity parses nothing, an edited
    file alone is parsed again."""
    copy = _package_copy(tmp_path, monkeypatch)
    parsed: list[str] = []
    real = identity._statement_digests

    def counting(path: str) -> str:
        parsed.append(path)
        return real(path)

    monkeypatch.setattr(identity._CODE_DIGESTS, "_digest", counting)
    try:
        first = _identity("report")
        assert parsed, "the first identity parses the declared modules"
        parsed.clear()
        assert _identity("report") == first and not parsed
        summary = copy / "report" / "summary.py"
        summary.write_text(summary.read_text() + "\nEDITED = 1\n")
        assert _identity("report") != first and parsed == [str(summary)]
    finally:
        monkeypatch.undo()
        identity.stage_identity.cache_clear()


@pytest.mark.parametrize("stage", sorted(identity.STAGES))
def test_no_stage_imports_the_live_loops(stage):
    """The speedup validation loops (speedup/live_loops/) run only in benchmarks/speedup_validation.py: no stage
    imports them, so no stage's identity or import closure holds them."""
    loops = set(identity.package_modules("speedup.live_loops.*"))
    assert loops and not loops & set(code_version.stage_modules(stage)), stage
