"""The kept states' code key (provenance/identity.py's STATE_CODE, by the one hash rule): a change of the capture
code recomputes every state instead of copying stale ones; a kept cache keyed by an earlier rule (the last
release's raw bytes of the same files, or each module's code keyed by its name) is copied once, as before the
upgrade. The real extract stage and a tiny target."""

from __future__ import annotations

import shutil

import pytest

from dflash_eval.cache.reuse import legacy_state_code_hashes
from dflash_eval.cache.store import HiddenCache
from dflash_eval.extract import stage as extract_stage
from dflash_eval.provenance import identity
from tests.support.checkout import REPO
from tests.support.extract_runs import (
    Counting,
    extract_settings,
    tiny_records,
    write_records,
)
from tests.support.tiny import tiny_target

LENGTHS = [7, 5, 9, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


def test_a_change_of_the_capture_code_recomputes_every_state(target_dir, tmp_path, monkeypatch):
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out = tmp_path / "hidden"
    extract_stage.extract(extract_settings(target_dir), completions, out)
    shutil.rmtree(out)
    counter = Counting(monkeypatch)
    extract_stage.extract(extract_settings(target_dir), completions, out)
    assert counter.calls == 0, "the same code: every state copied"

    monkeypatch.setattr(identity, "STATE_CODE", (*identity.STATE_CODE, "extract.positions"))  # other capture code
    shutil.rmtree(out)
    counter = Counting(monkeypatch)
    extract_stage.extract(extract_settings(target_dir), completions, out)
    assert counter.calls == len(LENGTHS) and HiddenCache(out).manifest["reused_samples"] == 0


@pytest.mark.parametrize("rule", [0, 1], ids=["last-release-bytes", "module-names"])
def test_kept_states_keyed_by_an_earlier_rule_are_copied_once(rule, target_dir, tmp_path, monkeypatch, caplog):
    completions = write_records(tmp_path / "c.jsonl", tiny_records(LENGTHS))
    out = tmp_path / "hidden"
    with monkeypatch.context() as old_release:  # the kept cache as the previous release keyed it
        old_release.setattr(extract_stage, "state_code_hash", lambda: legacy_state_code_hashes()[rule])
        extract_stage.extract(extract_settings(target_dir), completions, out)
    old_key = HiddenCache(out).manifest["state_key"]
    shutil.rmtree(out)
    counter = Counting(monkeypatch)
    with caplog.at_level("INFO"):
        extract_stage.extract(extract_settings(target_dir), completions, out)
    assert counter.calls == 0 and HiddenCache(out).manifest["reused_samples"] == len(LENGTHS)
    assert "keyed by an earlier rule's state code key" in caplog.text
    assert HiddenCache(out).manifest["state_key"] != old_key, "the new cache carries this release's key"


# The last commit whose code identities were keyed by module name (the rule before the layout-free one).
NAME_KEYED = "7af8def"


def test_the_name_keyed_state_key_is_reproduced_when_the_capture_code_is_unchanged(tmp_path):
    """The migration's promise: a kept cache made by the name-keyed rule is copied when STATE_CODE's code is the same
    under today's rule. For each module whose statements equal that commit's, today's name-keyed code (moved imports
    named as then) equals that commit's file's, so the legacy key is the one it wrote."""
    import ast
    import subprocess

    from dflash_eval.cache.reuse import name_keyed_code

    compared = 0
    for name in identity.STATE_CODE:
        path = identity.module_path(name).relative_to(REPO)
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{NAME_KEYED}:{path}"], capture_output=True, text=True)
        if shown.returncode:
            pytest.skip(f"no git history with {NAME_KEYED} here (a shallow clone?): {shown.stderr.strip()}")
        old = tmp_path / path.name
        old.write_text(shown.stdout)
        if identity._statements(str(old)) != identity._statements(str(identity.module_path(name))):
            continue  # its code changed for real: its states are recomputed, as they should be
        compared += 1
        assert name_keyed_code(name) == ast.unparse(identity._without_docstrings(ast.parse(shown.stdout))), name
    assert compared, "every STATE_CODE module changed since the name-keyed rule: this test checks nothing now"
