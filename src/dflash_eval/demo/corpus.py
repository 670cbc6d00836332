"""Training text for the embedded demo: the Python standard library's own sources.

The stdlib is the one body of code present on every machine that runs the pipeline, so the demo
tokenizer and target can be rebuilt offline. Its contents differ between Python versions, so every
build records `corpus_fingerprint` next to its outputs: two builds are comparable only if it matches.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Directories whose files are unrepresentative (vendored tests, tooling) or huge.
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_MIN_BYTES = 1_000
_MAX_BYTES = 64_000

Message = dict[str, str]


@dataclass(frozen=True)
class SourceFile:
    """One stdlib module: its path relative to the stdlib root and its text ('\\n' line ends)."""

    relpath: str
    text: str


def stdlib_root() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_ascii(path: Path) -> str | None:
    """Text of `path` if it is pure ASCII; None otherwise (keeps byte-level BPE on whole characters)."""
    try:
        raw = path.read_bytes()
        text = raw.decode("ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def list_stdlib_sources(root: Path | None = None) -> list[Path]:
    """All eligible `.py` files under the stdlib, sorted so that selection is reproducible.

    Walks with pruning: site-packages sits under the stdlib root and can hold gigabytes.
    """
    root = stdlib_root() if root is None else root
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_PARTS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if _MIN_BYTES <= size <= _MAX_BYTES:
                out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def select_sources(seed: int = 0, max_bytes: int = 3_000_000, root: Path | None = None) -> list[SourceFile]:
    """A seeded, size-capped subset of stdlib modules, in a deterministic order."""
    root = stdlib_root() if root is None else root
    paths = list_stdlib_sources(root)
    random.Random(seed).shuffle(paths)
    chosen: list[SourceFile] = []
    total = 0
    for path in paths:
        text = _read_ascii(path)
        if text is None:
            continue
        if total + len(text) > max_bytes:
            continue
        chosen.append(SourceFile(path.relative_to(root).as_posix(), text))
        total += len(text)
    return chosen


def corpus_fingerprint(files: list[SourceFile]) -> dict[str, object]:
    """Identity of a corpus: Python version, file count, bytes and a sha256 over names and texts."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relpath.encode() + b"\0" + f.text.encode() + b"\0")
    return {
        "python": sys.version.split()[0],
        "files": len(files),
        "bytes": sum(len(f.text) for f in files),
        "sha256": digest.hexdigest(),
    }


# ---------------------------------------------------------------- chat-formatted training examples


@dataclass(frozen=True)
class _Definition:
    kind: str  # "function" | "class"
    name: str
    signature: str
    doc: str  # first paragraph of the docstring
    source: str  # dedented source of the whole definition
    source_without_doc: str


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines())


def _definitions(source: SourceFile, max_lines: int) -> list[_Definition]:
    """Functions and classes with docstrings, short enough to be one training example."""
    try:
        tree = ast.parse(source.text)
    except (SyntaxError, ValueError):
        return []
    lines = source.text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or node.end_lineno is None or node.decorator_list:
            continue
        if node.end_lineno - node.lineno + 1 > max_lines or len(node.body) < 2:
            continue
        text = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        doc_node = node.body[0]
        assert doc_node.end_lineno is not None
        without = textwrap.dedent(
            "".join(lines[node.lineno - 1 : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno])
        )
        if isinstance(node, ast.ClassDef):
            signature = node.name
        else:
            signature = f"{node.name}({ast.unparse(node.args)})"
        found.append(
            _Definition(
                kind="class" if isinstance(node, ast.ClassDef) else "function",
                name=node.name,
                signature=signature,
                doc=_first_paragraph(doc),
                source=text.rstrip() + "\n",
                source_without_doc=without.rstrip() + "\n",
            )
        )
    return found


def _continuation(text: str, rng: random.Random, max_lines: int) -> tuple[str, str] | None:
    """A random window of lines split into a head (prompt) and its rest (answer)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 8:
        return None
    start = rng.randrange(0, len(lines) - 6)
    head_n = rng.randint(3, max(3, max_lines // 3))
    rest_n = rng.randint(4, max_lines)
    head = "".join(lines[start : start + head_n])
    # No leading blank lines: the prompt's "assistant\n" must not merge with them into one token.
    rest = "".join(lines[start + head_n : start + head_n + rest_n]).lstrip("\n")
    if not head.strip() or not rest.strip():
        return None
    return head, rest


def chat_examples(files: list[SourceFile], seed: int = 0, max_lines: int = 24) -> Iterator[list[Message]]:
    """An endless, seeded stream of user/assistant turns built from stdlib code.

    Four kinds, matched to the demo prompts: continue code, write a named function or class from
    its docstring, explain a function (answer: its docstring), add a docstring (answer: the code).
    """
    rng = random.Random(seed)
    defs = [d for f in files for d in _definitions(f, max_lines)]
    if not files:
        raise ValueError("chat_examples needs at least one source file")
    while True:
        roll = rng.random()
        if roll < 0.45 or not defs:
            pair = _continuation(rng.choice(files).text, rng, max_lines)
            if pair is None:
                continue
            user, answer = f"Continue this Python code:\n{pair[0]}", pair[1]
        else:
            d = rng.choice(defs)
            if roll < 0.75:
                user = f"Write a Python {d.kind} `{d.signature}`. {d.doc}"
                answer = d.source
            elif roll < 0.9:
                user, answer = f"Explain what this Python code does:\n{d.source_without_doc}", d.doc
            else:
                user, answer = f"Add a docstring to this Python {d.kind}:\n{d.source_without_doc}", d.source
        yield [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
