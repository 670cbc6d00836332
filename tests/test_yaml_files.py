"""The strict YAML reader: repeated keys and syntax errors name the file and line."""

from __future__ import annotations

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.yaml_files import DuplicateKeyError, read_yaml


def test_a_plain_document_reads_as_pyyaml_reads_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\nb:\n  c: [1, 2]\n  d: {e: x}\nbase: &b {k: 1}\nuse:\n  <<: *b\n  k: 2\n")
    assert read_yaml(path) == {"a": 1, "b": {"c": [1, 2], "d": {"e": "x"}}, "base": {"k": 1}, "use": {"k": 2}}


@pytest.mark.parametrize(
    "text, line, first, key",
    [
        ("a: 1\nb: 2\na: 3\n", 3, 1, "a"),
        ("drafters:\n  x:\n    path: p\n  y: {}\n  x:\n    path: q\n", 5, 2, "x"),
        ("d: {k: 1, k: 2}\n", 1, 1, "k"),
    ],
)
def test_a_repeated_key_is_an_error_naming_file_line_and_first_line(tmp_path, text, line, first, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(DuplicateKeyError) as error:
        read_yaml(path)
    assert f"{path}:{line}: key {key!r} appears twice in one mapping (first at line {first})" in str(error.value)


def test_equal_keys_in_different_mappings_are_fine(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a:\n  path: 1\nb:\n  path: 2\n")
    assert read_yaml(path) == {"a": {"path": 1}, "b": {"path": 2}}


def test_a_tab_is_an_error_naming_the_file_line_and_the_fix(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("a:\n\tb: 1\n")
    with pytest.raises(DflashEvalError) as error:
        read_yaml(path)
    assert str(error.value).startswith(f"{path}:2:1: not valid YAML")
    assert "never tabs" in str(error.value)
