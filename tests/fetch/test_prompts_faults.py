"""Prompt files that would ask nothing, or that are not UTF-8: refused naming the file and the line, and the file
is left as it was."""

from __future__ import annotations

import json

import pytest

from dflash_eval.fetch.prompts import PromptFileError, load_prompts

GOOD = {"id": "ok", "messages": [{"role": "user", "content": "Write a sort."}]}


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (
            {"id": "b", "messages": [{"role": "user", "content": ""}]},
            "messages[0] (user): content is empty or whitespace only",
        ),
        ({"id": "b", "messages": [{"role": "user", "content": " \n\t"}]}, "content is empty or whitespace only"),
        ({"id": "b", "messages": [{"role": "system", "content": "Be brief."}]}, 'has no "user" message (only system)'),
        (
            {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]},
            "messages[1] (user): content is empty",
        ),
        ({"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}, "holds no text"),
        ({"id": "b", "messages": [{"role": "user", "content": 7}]}, "content must be a string, not int"),
        ({"id": "b", "turns": ["Hi", "   "]}, '"turns"[1] is empty or whitespace only'),
        ({"id": "b", "turns": ["Hi"], "system": "  "}, '"system" is whitespace only'),
    ],
)
def test_a_prompt_that_asks_nothing_is_refused_naming_file_and_line(tmp_path, record, problem):
    path = tmp_path / "prompts.jsonl"
    text = json.dumps(GOOD) + "\n" + json.dumps(record) + "\n"
    path.write_text(text)
    with pytest.raises(PromptFileError) as error:
        load_prompts(path)
    assert str(error.value).startswith(f"{path}:2: ") and problem in str(error.value)
    assert path.read_text() == text


def test_a_system_message_and_content_parts_with_text_are_accepted(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
        {"id": "c", "turns": ["Hi", "More"], "system": ""},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.id for p in load_prompts(path)] == ["a", "b", "c"]


def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path):
    path = tmp_path / "prompts.jsonl"
    data = (json.dumps(GOOD) + "\n").encode() + b'{"id": "b", "messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    path.write_bytes(data)
    with pytest.raises(
        PromptFileError, match=r"prompts.jsonl:2: byte 0xe9 at column 58 is not UTF-8; save the file as UTF-8"
    ):
        load_prompts(path)
    assert path.read_bytes() == data


def test_an_unreadable_path_is_named(tmp_path):
    with pytest.raises(PromptFileError, match=r"nowhere.jsonl: cannot be read \(No such file or directory\)"):
        load_prompts(tmp_path / "nowhere.jsonl")


@pytest.mark.parametrize(
    ("encode", "named"),
    [
        (lambda text: __import__("gzip").compress(text.encode()), "is gzip-compressed: decompress it first"),
        (lambda text: text.encode("utf-16"), "is UTF-16 (little-endian) text: save it as UTF-8"),
        (lambda text: text.encode("utf-16-be"), "holds NUL bytes: UTF-16 or UTF-32 text without a byte-order mark"),
        (lambda text: text.encode("utf-32"), "is UTF-32 (little-endian) text"),
        (lambda text: __import__("bz2").compress(text.encode()), "is bzip2-compressed"),
        (lambda text: __import__("lzma").compress(text.encode()), "is xz-compressed"),
    ],
)
def test_a_compressed_or_utf16_file_is_named_as_what_it_is(tmp_path, encode, named):
    """Before, the first odd byte was explained as 'not UTF-8 (iconv -f latin1)', which sends the user astray."""
    path = tmp_path / "prompts.jsonl"
    data = encode(json.dumps(GOOD) + "\n")
    path.write_bytes(data)
    with pytest.raises(PromptFileError) as error:
        load_prompts(path)
    assert str(error.value) == f"{path}: {named}" or str(error.value).startswith(f"{path}: {named}")
    assert "latin1" not in str(error.value)
    assert path.read_bytes() == data


def test_a_utf8_file_that_starts_with_a_brace_is_read(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    assert [p.id for p in load_prompts(path)] == ["ok"]
