"""Prompt files: JSONL, one prompt a line, either
- single turn: {"id": str, "messages": [{"role": str, "content": str}, ...]}: one completion of the whole list;
- multi-turn (MT-Bench style): {"id": str, "turns": [str, ...], "system": str (optional)}: the user turns,
  answered in order, each answer becoming the assistant message before the next turn.

Loading is strict: a malformed line is an error naming the file and the line, never a skipped
prompt, because a silently shorter prompt set changes every number downstream.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError


class PromptFileError(DflashEvalError):
    """A prompt file that cannot be used as it is; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """`messages` is the whole conversation of a single-turn prompt, or the fixed prefix (a system
    message, or nothing) of a multi-turn one, whose user turns are `turns`."""

    id: str
    messages: list[dict[str, Any]]
    turns: tuple[str, ...] = ()


def _blank(text: str) -> bool:
    return not text.strip()


def _content_problem(content: Any) -> str | None:
    """Why a message's content holds no text to send (empty, whitespace only, wrong type), or None."""
    if isinstance(content, str):
        return "is empty or whitespace only" if _blank(content) else None
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, ...]
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        if len(texts) < len(content) or not all(isinstance(t, str) for t in texts):
            return 'must be a string or a list of {"type": "text", "text": str} parts'
        return "holds no text (empty or whitespace-only parts)" if all(_blank(t) for t in texts) else None
    return f"must be a string, not {type(content).__name__}"


def _check_record(rec: Any) -> str | None:
    """Why `rec` is not a valid prompt record, or None when it is.

    A prompt must ask something: an empty or whitespace-only message, or a conversation without a
    user message, would still get a completion (from the template alone) and count in every tau.
    """
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not isinstance(rec.get("id"), str) or not rec["id"]:
        return 'needs "id", a non-empty string'
    if "turns" in rec:
        if "messages" in rec:
            return 'has both "messages" and "turns": give one'
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            return '"turns" must be a non-empty list of strings'
        blank = [i for i, t in enumerate(turns) if _blank(t)]
        if blank:
            return f'"turns"[{blank[0]}] is empty or whitespace only: write the user turn, or remove it'
        system = rec.get("system", "")
        if not isinstance(system, str):
            return '"system" must be a string'
        if system and _blank(system):
            return '"system" is whitespace only: write the system prompt, or remove the key'
        return None
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        return 'needs "messages", a non-empty list (or "turns", a list of user turns)'
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or "content" not in msg:
            return f'messages[{i}] needs "role" (a string) and "content"'
        problem = _content_problem(msg["content"])
        if problem:
            return f"messages[{i}] ({msg['role']}): content {problem}; write the message, or remove it"
    if not any(msg["role"] == "user" for msg in messages):
        roles = ", ".join(sorted({msg["role"] for msg in messages}))
        return f'has no "user" message (only {roles}): nothing for the target to answer'
    return None


def prompt_from_record(rec: Any, where: str) -> Prompt:
    """One prompt from a prompt-file record (a parsed JSONL line, or a preset's row mapped to one);
    `where` ("file:line", "preset gsm8k row 3") starts the error message of an invalid record."""
    problem = _check_record(rec)
    if problem:
        raise PromptFileError(f"{where}: {problem}")
    if "turns" in rec:
        system = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        return Prompt(id=rec["id"], messages=system, turns=tuple(rec["turns"]))
    return Prompt(id=rec["id"], messages=rec["messages"])


def record_ids(prompt: Prompt) -> list[str]:
    """The ids of a prompt's records: its own id, or one per turn for a multi-turn prompt."""
    if not prompt.turns:
        return [prompt.id]
    return [f"{prompt.id}#{k}" for k in range(1, len(prompt.turns) + 1)]


def note_unique_id(first: dict[Any, str], prompt: Prompt, where: str) -> None:
    """Record where `prompt`'s id and its records' ids were seen; a second prompt with that id, or whose
    records' ids are taken (a prompt "q1#2" beside a multi-turn "q1"), would share a record: an error
    naming both places, found when the prompts are loaded (the workflow loads them before any job)."""
    if prompt.id in first:
        raise PromptFileError(f"{where}: duplicate id {prompt.id!r} (first at {first[prompt.id]})")
    rids = record_ids(prompt)
    for rid in rids:
        if ("record", rid) in first:
            raise PromptFileError(
                f"{where}: prompt {prompt.id!r} has record id {rid!r}, which the prompt at {first['record', rid]} "
                "already has (a multi-turn prompt's records are '<id>#<turn>'); rename one of the two ids"
            )
    first[prompt.id] = where
    for rid in rids:
        first["record", rid] = where


def json_lines(
    path: Path,
    lines: Iterable[str],
    error: type[DflashEvalError] = PromptFileError,
) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSONL file; a bad line is `error` naming path:line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        yield lineno, value


_ENCODINGS = (  # what a prompt file may start with that is not UTF-8 text, longest signature first
    (b"\xff\xfe\x00\x00", "is UTF-32 (little-endian) text: save it as UTF-8 (iconv -f utf-32 -t utf-8)"),
    (b"\x00\x00\xfe\xff", "is UTF-32 (big-endian) text: save it as UTF-8 (iconv -f utf-32 -t utf-8)"),
    (b"\xff\xfe", "is UTF-16 (little-endian) text: save it as UTF-8 (iconv -f utf-16 -t utf-8)"),
    (b"\xfe\xff", "is UTF-16 (big-endian) text: save it as UTF-8 (iconv -f utf-16 -t utf-8)"),
    (b"\x1f\x8b", "is gzip-compressed: decompress it first (gunzip -k FILE) and name the .jsonl"),
    (b"(\xb5/\xfd", "is zstd-compressed: decompress it first (zstd -d FILE) and name the .jsonl"),
    (b"BZh", "is bzip2-compressed: decompress it first (bunzip2 -k FILE) and name the .jsonl"),
    (b"\xfd7zXZ", "is xz-compressed: decompress it first (unxz -k FILE) and name the .jsonl"),
)


def _not_plain_utf8(head: bytes) -> str | None:
    """What a file's first bytes show it to be when it is not UTF-8 text (a UTF-8 BOM is fine), or None."""
    for signature, kind in _ENCODINGS:
        if head.startswith(signature):
            return kind
    if b"\x00" in head:
        return (
            "holds NUL bytes: UTF-16 or UTF-32 text without a byte-order mark, or not text at all; "
            "save it as UTF-8 (iconv -f utf-16le -t utf-8)"
        )
    return None


def utf8_lines(path: Path, error: type[DflashEvalError] = PromptFileError) -> Iterator[str]:
    """The lines of a text file; a byte that is not UTF-8 is `error` naming path:line and column, and a file
    that is compressed or in another Unicode encoding is named as what it is."""
    try:
        with open(path, "rb") as handle:
            kind = _not_plain_utf8(handle.read(6))
            if kind:
                raise error(f"{path}: {kind}")
            handle.seek(0)
            for lineno, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise error(
                        f"{path}:{lineno}: byte 0x{raw[exc.start]:02x} at column {exc.start + 1} is not "
                        "UTF-8; save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                    ) from None
                yield line
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror}); check the path in config.yaml") from None


def load_prompts(path: str | Path) -> list[Prompt]:
    """All prompts of a JSONL file, in file order; blank lines are allowed, duplicate ids are not."""
    path = Path(path)
    prompts: list[Prompt] = []
    first: dict[Any, str] = {}
    for lineno, rec in json_lines(path, utf8_lines(path)):
        prompts.append(prompt_from_record(rec, f"{path}:{lineno}"))
        note_unique_id(first, prompts[-1], f"{path}:{lineno}")
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def select_subset(prompts: list[Prompt], max_samples: int | None, seed: int, by_id: bool = False) -> list[Prompt]:
    """A deterministic subset of `max_samples` prompts (all when None), kept in file order.

    `by_id` (a prompt file): drawn from the prompts sorted by id, so that the subset depends on the prompts, not
    on their order in the file (a reordered file must not pick another subset). A preset's rows keep the
    dataset's own order, which nobody edits, and the subsets drawn from it so far."""
    if max_samples is None or max_samples >= len(prompts):
        return list(prompts)
    if max_samples < 1:
        raise DflashEvalError(f"max_samples must be at least 1, got {max_samples}")
    population = sorted(range(len(prompts)), key=lambda i: prompts[i].id) if by_id else range(len(prompts))
    keep = sorted(random.Random(seed).sample(population, max_samples))
    return [prompts[i] for i in keep]


def order_free_digest(prompts: list[Prompt]) -> str:
    """sha256 of a prompt set as a set: every prompt's id, messages and turns, in id order. The fetch rule's param
    for a prompt file (instead of its mtime), so that a reordered, touched or re-saved file reruns nothing and an
    edited prompt reruns the fetch."""
    canonical = [[p.id, p.messages, list(p.turns)] for p in sorted(prompts, key=lambda p: p.id)]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
