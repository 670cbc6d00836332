"""SGLang 0.5.23's protocol field names, read from its source: the demo server (dflash_eval.demo.server)
answers with them and the tests check fetch against them.

`PROTOCOL_FIELDS` (sglang_0_5_23_fields.json) is what `fields_from_source` reads out of the wheel's
`sglang/srt/entrypoints/openai/protocol.py` (its pydantic models do not import without SGLang's own
dependencies, so the names are read with `ast`); tests/fetch/test_sglang.py re-reads them from an
installed wheel (`pip install --no-deps sglang==0.5.23`) and compares.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("sglang_0_5_23_fields.json")
# source file under sglang/srt/ -> the classes read from it
SOURCES = {
    "entrypoints/openai/protocol.py": (
        "CompletionRequest", "CompletionResponse", "CompletionResponseChoice", "ChatCompletionRequest",
        "ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatMessage", "UsageInfo", "SglExt",
        "SpecTokensDetails", "ModelCard", "ModelList"),
    "managers/io_struct.py": ("GenerateReqInput",),
}


def wheel_fields(srt: Path) -> dict[str, list[str]]:
    """Every class of SOURCES with its fields, read from an SGLang checkout's or wheel's `sglang/srt` directory."""
    out: dict[str, list[str]] = {}
    for relative, classes in SOURCES.items():
        out.update(fields_from_source(Path(srt) / relative, classes))
    return out


def fields_from_source(source: Path, classes: tuple[str, ...]) -> dict[str, list[str]]:
    """Public annotated fields of each class in `source`, bases defined in the same file included."""
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    defs = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> list[str]:
        node = defs[name]
        out: list[str] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in defs:
                out += fields(base.id)
        out += [stmt.target.id for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and not stmt.target.id.startswith("_")]
        return list(dict.fromkeys(out))

    return {name: fields(name) for name in classes}


PROTOCOL_FIELDS: dict[str, list[str]] = json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def unknown_fields(body: dict, model: str) -> list[str]:
    """Keys of a request or response body that SGLang's model `model` does not define."""
    return sorted(set(body) - set(PROTOCOL_FIELDS[model]))
