"""SGLang 0.5.23's protocol field names, read from its source: the demo server (dflash_eval.demo.server)
answers with them and the tests check fetch against them.

`PROTOCOL_FIELDS` (sglang_0_5_23_fields.json) is what `fields_from_source` reads out of the wheel's
`sglang/srt` source (its modules do not import without SGLang's own dependencies, so the names are read
with `ast`): the OpenAI-protocol pydantic models, `/generate`'s input, the server args `/get_server_info`
reports (the Spec, Model and Serving groups; SGLang flattens every group into that answer), and the keys
`/model_info` and `/server_info` add themselves, and the keys a request's `meta_info` may hold (`MetaInfo`: no
model defines it; the tokenizer manager and the time stats write them into a dict, `meta_info_keys_from_source`).
tests/fetch/test_sglang.py re-reads them from the wheel
(.ci/run downloads it and sets DFLASH_EVAL_SGLANG_SRC) and compares. The demo server checks every answer
it sends against them (`check_fields`), and that test checks every response field fetch reads.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

VERSION = "0.5.23"
SNAPSHOT = Path(__file__).with_name("sglang_0_5_23_fields.json")
# source file under sglang/srt/ -> the classes read from it
SOURCES = {
    "entrypoints/openai/protocol.py": (
        "CompletionRequest",
        "CompletionResponse",
        "CompletionResponseChoice",
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "ChatCompletionResponseChoice",
        "ChatMessage",
        "UsageInfo",
        "SglExt",
        "SpecTokensDetails",
        "ModelCard",
        "ModelList",
    ),
    "managers/io_struct.py": ("GenerateReqInput",),
    "arg_groups/fields/spec.py": ("Spec",),
    "arg_groups/fields/model.py": ("Model",),
    "arg_groups/fields/serving.py": ("Serving",),
}
# source file -> {snapshot name: the function whose dict literals' string keys are that answer's own keys}
DICT_SOURCES = {"entrypoints/http_server.py": {"ModelInfo": "model_info", "ServerInfo": "server_info"}}
# source file -> the Class.method functions that write meta_info (e2e_latency, the spec counters; with
# --enable-metrics first_token_latency, queue_time, decode_throughput): snapshot name MetaInfo
META_INFO_SOURCES = {
    "managers/tokenizer_manager.py": (
        "TokenizerManager._handle_batch_output",
        "TokenizerManager._calculate_spec_decoding_metrics",
    ),
    "observability/req_time_stats.py": (
        "APIServerReqTimeStats.convert_to_output_meta_info",
        "SchedulerReqTimeStats.convert_to_output_meta_info",
    ),
}
META_INFO_NAMES = ("meta_info", "meta_data")  # the dicts those functions fill
# /get_server_info's answer: the flattened server args plus ServerInfo's own keys
SERVER_INFO = ("Spec", "Model", "Serving", "ServerInfo")


def wheel_fields(srt: Path) -> dict[str, list[str]]:
    """Every class of SOURCES with its fields, read from an SGLang checkout's or wheel's `sglang/srt` directory."""
    out: dict[str, list[str]] = {}
    for relative, classes in SOURCES.items():
        out.update(fields_from_source(Path(srt) / relative, classes))
    for relative, functions in DICT_SOURCES.items():
        out.update(dict_keys_from_source(Path(srt) / relative, functions))
    out["MetaInfo"] = list(
        dict.fromkeys(
            key
            for relative, methods in META_INFO_SOURCES.items()
            for key in meta_info_keys_from_source(Path(srt) / relative, methods)
        )
    )
    return out


def meta_info_keys_from_source(source: Path, methods: tuple[str, ...]) -> list[str]:
    """The string keys `methods` ("Class.method") write into a META_INFO_NAMES dict: `meta_info["k"] = ...`,
    `meta_info = {"k": ...}` and `meta_info.update({"k": ...})`, in source order."""
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    defs = {
        f"{cls.name}.{node.name}": node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }

    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in META_INFO_NAMES

    keys: list[str] = []
    for method in methods:
        for node in ast.walk(defs[method]):
            literal = None
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Store)
                and named(node.value)
                and isinstance(node.slice, ast.Constant)
            ):
                keys.append(node.slice.value)
            elif isinstance(node, ast.Assign) and any(named(t) for t in node.targets):
                literal = node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and named(node.func.value)
                and node.args
            ):
                literal = node.args[0]
            if isinstance(literal, ast.Dict):
                keys += [key.value for key in literal.keys if isinstance(key, ast.Constant)]
    return list(dict.fromkeys(k for k in keys if isinstance(k, str)))


def dict_keys_from_source(source: Path, functions: dict[str, str]) -> dict[str, list[str]]:
    """For each name, the string keys of the dict literals in the (async) function it maps to."""
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    defs = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {
        name: list(
            dict.fromkeys(
                key.value
                for node in ast.walk(defs[function])
                if isinstance(node, ast.Dict)
                for key in node.keys
                if isinstance(key, ast.Constant)
            )
        )
        for name, function in functions.items()
    }


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
        out += [
            stmt.target.id
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and not stmt.target.id.startswith("_")
        ]
        return list(dict.fromkeys(out))

    return {name: fields(name) for name in classes}


PROTOCOL_FIELDS: dict[str, list[str]] = json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def unknown_fields(body: dict, *models: str) -> list[str]:
    """Keys of a request or response body that none of SGLang's models `models` defines."""
    return sorted(set(body) - {name for model in models for name in PROTOCOL_FIELDS[model]})


def check_fields(body: dict, *models: str) -> dict:
    """`body`, after checking that SGLang's `models` define every key of it (ValueError naming the strays)."""
    unknown = unknown_fields(body, *models)
    if unknown:
        raise ValueError(f"fields {unknown} are not in SGLang {VERSION}'s {' / '.join(models)} ({SNAPSHOT.name})")
    return body
