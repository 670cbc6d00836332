"""The completions file, results/completions/<dataset>.jsonl (docs/contracts.md): its line writer and its reader.

Fetch writes every record with `serialize` (into the `.partial` file, then the output: fetch.store);
extract, evaluate, the report and tools/compare_backends read through `iter_records` or
`read_completions`, so a damaged or foreign file is refused the same way everywhere, with an error
that names the file, the line and the key, before any stage works on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError

TOKEN_KEYS = ("prompt_token_ids", "completion_token_ids")
# The penalties a record's `request` names, with SGLang's "off" values (entrypoints/openai/protocol.py:1062-1068
# and the request models' defaults); a record served with another value was served penalized.
PENALTY_OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
_DAMAGED = "the file is damaged: delete it and re-run fetch"


class CompletionsError(DflashEvalError):
    """A completions file that is missing, not JSON Lines, or lacks what the reading stage needs."""


def serialize(record: dict[str, Any]) -> bytes:
    """One JSONL line of a record, as both the partial file and the output hold it (UTF-8, not escaped)."""
    return (json.dumps(record, ensure_ascii=False) + "\n").encode()


def parse_line(path: str | Path, number: int, line: str | bytes) -> dict[str, Any]:
    """The record on line `number`: a JSON object with a non-empty string id, else an error naming path:line."""
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError for bytes
        raise CompletionsError(f"{path}:{number}: not a JSON record ({error}); {_DAMAGED}") from None
    if not isinstance(record, dict) or "id" not in record:
        raise CompletionsError(f"{path}:{number}: not a completions record (no id); {_DAMAGED}")
    if not isinstance(record["id"], str) or not record["id"]:
        raise CompletionsError(f"{path}:{number}: id {record['id']!r} is not a non-empty string; {_DAMAGED}")
    return record


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each non-blank line, in file order; ids must not repeat."""
    path = Path(path)
    if not path.is_file():
        raise CompletionsError(f"completions file {path} not found; run the fetch stage first")
    first: dict[str, int] = {}
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = parse_line(path, number, line)
            if record["id"] in first:
                raise CompletionsError(
                    f"{path}:{number}: sample id {record['id']!r} repeats (first on line "
                    f"{first[record['id']]}); {_DAMAGED}"
                )
            first[record["id"]] = number
            yield number, record


def read_completions(path: str | Path, need_tokens: bool = False) -> list[dict[str, Any]]:
    """Every record of a completions file, in file order; at least one.

    With `need_tokens` (extraction reads them), each record must hold `prompt_token_ids` (a
    non-empty list of ints) and `completion_token_ids` (a list of ints).
    """
    records = []
    for number, record in iter_records(path):
        if need_tokens:
            _check_tokens(path, number, record)
        records.append(record)
    if not records:
        raise CompletionsError(f"{path} holds no completions; re-run fetch")
    return records


def _check_tokens(path: str | Path, number: int, record: dict[str, Any]) -> None:
    where = f"{path}:{number}: sample {record['id']!r}"
    for key in TOKEN_KEYS:
        if key not in record:
            raise CompletionsError(f"{where}: record lacks {key!r}; {_DAMAGED}")
        ids = record[key]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise CompletionsError(f"{where}: {key!r} is not a list of token ids (integers); {_DAMAGED}")
    if not record["prompt_token_ids"]:
        raise CompletionsError(
            f"{where} has no prompt tokens; the target needs at least one to start from "
            "(fix that prompt and re-run fetch)"
        )


_DRAW = re.compile(r"#s\d+$")


def prompt_cluster(sample_id: str, sampled: bool) -> str:
    """The prompt (turn) a sampled completion answers: its id without the `#s<k>` of draw k, which the n draws of
    one prompt share (fetch/sampling.py names them); a greedy record is its own. The bootstrap resamples these
    clusters (stats), since the draws of one prompt share its difficulty."""
    return _DRAW.sub("", sample_id) if sampled else sample_id
