"""Small file helpers shared by every stage: atomic writes and content hashes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Content hash of a file, read in chunks so large checkpoints never sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary sibling and rename, so a crash never leaves a half-written file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """atomic_write_text for content already encoded (the fetch stage's serialized records)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results must be readable like any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _strict(value: Any) -> Any:
    """NaN and Inf become null: strict JSON readers (jq, browsers) reject them."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def atomic_write_json(path: str | Path, data: Any) -> None:
    """JSON twin of atomic_write_text, indented for humans and sorted for stable diffs."""
    atomic_write_text(path, json.dumps(_strict(data), indent=2, sort_keys=True, allow_nan=False) + "\n")
