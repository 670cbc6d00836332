"""The completions file: one line writer, one validated reader, and every stage reads through it."""

from __future__ import annotations

import json

import pytest

from dflash_eval import completions
from dflash_eval.completions import (
    CompletionsError,
    iter_records,
    read_completions,
    serialize,
)
from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch.store import read_records
from dflash_eval.report import trust

RECORD = {"id": "a", "prompt_token_ids": [1, 2], "completion_token_ids": [3], "text": "café ☃"}


def _file(tmp_path, *lines: str):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_serialized_records_read_back_equal_and_unescaped(tmp_path):
    records = [RECORD, {**RECORD, "id": "b#2", "prompt_token_ids": [9]}]
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"".join(map(serialize, records)))
    assert read_completions(path, need_tokens=True) == records
    assert "café ☃" in path.read_text(encoding="utf-8")  # UTF-8 text, not \u escapes
    assert [number for number, _ in iter_records(path)] == [1, 2]


def test_blank_lines_are_skipped_and_line_numbers_count_them(tmp_path):
    path = _file(tmp_path, json.dumps(RECORD), "", "{oops")
    with pytest.raises(CompletionsError, match=r"c.jsonl:3: not a JSON record \(Expecting property name"):
        read_completions(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", r"c.jsonl:2: not a completions record \(no id\)"),
        ('{"text": "x"}', r"c.jsonl:2: not a completions record \(no id\)"),
        ('{"id": 7}', r"c.jsonl:2: id 7 is not a non-empty string"),
        ('{"id": ""}', r"c.jsonl:2: id '' is not a non-empty string"),
        (json.dumps(RECORD), r"c.jsonl:2: sample id 'a' repeats \(first on line 1\)"),
    ],
)
def test_a_bad_record_is_named_by_file_and_line(tmp_path, line, message):
    path = _file(tmp_path, json.dumps(RECORD), line)
    with pytest.raises(CompletionsError, match=message):
        read_completions(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt_token_ids": None}, r"c.jsonl:1: sample 'a': 'prompt_token_ids' is not a list of token ids"),
        (
            {"completion_token_ids": [1, "2"]},
            r"c.jsonl:1: sample 'a': 'completion_token_ids' is not a list of token ids",
        ),
        ({"prompt_token_ids": []}, r"c.jsonl:1: sample 'a' has no prompt tokens"),
    ],
)
def test_token_ids_are_checked_when_the_reader_needs_them(tmp_path, change, message):
    path = _file(tmp_path, json.dumps({**RECORD, **change}))
    assert read_completions(path)[0]["id"] == "a"  # evaluate and the report do not read the token ids
    with pytest.raises(CompletionsError, match=message):
        read_completions(path, need_tokens=True)


def test_a_missing_token_key_is_named(tmp_path):
    record = {k: v for k, v in RECORD.items() if k != "completion_token_ids"}
    with pytest.raises(CompletionsError, match=r"c.jsonl:1: sample 'a': record lacks 'completion_token_ids'"):
        read_completions(_file(tmp_path, json.dumps(record)), need_tokens=True)


def test_missing_and_empty_files_say_what_to_run(tmp_path):
    with pytest.raises(CompletionsError, match=r"completions file .*nope.jsonl not found; run the fetch stage"):
        read_completions(tmp_path / "nope.jsonl")
    with pytest.raises(CompletionsError, match=r"c.jsonl holds no completions"):
        read_completions(_file(tmp_path, ""))
    assert list(iter_records(_file(tmp_path, ""))) == []  # the report counts an empty file as 0 records


def test_every_reader_refuses_a_bad_line_the_same_way(tmp_path):
    """fetch's resume, the report, extract and evaluate (read_completions) all name the file and line."""
    path = _file(tmp_path, json.dumps(RECORD), '{"text": "no id"}')
    for read in (read_records, trust.scan_completions, read_completions):
        with pytest.raises(DflashEvalError, match=r"c.jsonl:2: not a completions record \(no id\)"):
            read(path)


def test_the_stages_import_the_one_reader():
    """No stage keeps a reader of its own (the issue found three, one raising a bare KeyError)."""
    from dflash_eval.evaluate import stage as evaluate
    from dflash_eval.extract import stage as extract
    from dflash_eval.fetch import store

    assert evaluate.read_completions is extract.read_completions is completions.read_completions
    assert store.serialize is completions.serialize and store.parse_line is completions.parse_line
