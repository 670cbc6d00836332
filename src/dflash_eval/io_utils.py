"""Small file helpers shared by every stage: atomic writes, content hashes, safetensors headers."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError

_MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own limit


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


def read_json_object(file: str | Path) -> dict[str, Any]:
    """A JSON object from a file (a config.json, an index), with errors that name the file."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DflashEvalError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise DflashEvalError(f"{file}: not a JSON object")
    return data


def safetensors_header(path: str | Path, fix: str) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape, data_offsets} of a safetensors file, from its header alone.

    Reads a few kilobytes, not the weights, so the workflow can check every checkpoint when it loads.
    A file that is not safetensors, or whose size is not what its header says (truncated by a copy
    that stopped, or padded), is an error naming the file and `fix`, as the safetensors package's
    own error ("incomplete metadata, file not fully covered") does not.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
                raise DflashEvalError(f"{path}: not a safetensors file ({size} bytes, no valid header); {fix}")
            header = json.loads(handle.read(length))
    except OSError as error:
        raise DflashEvalError(f"{path}: cannot be read ({error.strerror}); {fix}") from None
    except (UnicodeDecodeError, ValueError):
        raise DflashEvalError(f"{path}: the safetensors header is not valid JSON (a damaged file); {fix}") from None
    if not isinstance(header, dict):
        raise DflashEvalError(f"{path}: the safetensors header is not a JSON object (a damaged file); {fix}")
    header.pop("__metadata__", None)
    try:
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise DflashEvalError(f"{path}: the safetensors header lacks data_offsets (a damaged file); {fix}") from None
    if 8 + length + end != size:
        raise DflashEvalError(
            f"{path}: {size} bytes, but its header says {8 + length + end}: the file is "
            f"{'truncated' if size < 8 + length + end else 'longer than its tensors'}; {fix}"
        )
    return header
