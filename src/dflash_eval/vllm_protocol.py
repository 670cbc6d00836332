"""vLLM 0.34.0's protocol field names, read from its wheel: fetch.vllm reads answers with them, the demo server's
vLLM mode answers with them, and the tests check both against them.

`PROTOCOL_FIELDS` (vllm_0_34_0_fields.json) is what `wheel_fields` reads out of the wheel's `vllm` package
directory with `ast` (its modules do not import without vLLM's own dependencies): the OpenAI-protocol pydantic
models of the completions and chat endpoints, the per-request metrics (`metrics.speculative_decoding`), the keys
`RequestSpecDecodeMetrics.to_dict` writes into it, the speculative and observability config fields fetch reads
from `/server_info`, the values of the literal settings that decide the verification rule, and the routes of
the sleep-mode and basic endpoints. tests/fetch/test_vllm_protocol.py re-reads them from the wheel
(.ci/run downloads it and sets DFLASH_EVAL_VLLM_SRC) and compares both ways; docs/vllm_protocol.md gives
each fact's source line.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from dflash_eval.sglang_protocol import fields_from_source

VERSION = "0.34.0"
SNAPSHOT = Path(__file__).with_name("vllm_0_34_0_fields.json")
# source file under vllm/ -> the classes whose annotated fields are read
SOURCES = {
    "entrypoints/openai/completion/protocol.py": (
        "CompletionRequest",
        "CompletionResponse",
        "CompletionResponseChoice",
    ),
    "entrypoints/openai/chat_completion/protocol.py": (
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "ChatCompletionResponseChoice",
        "ChatMessage",
    ),
    "entrypoints/generate/base/protocol.py": ("SpeculativeDecodingMetrics", "PerRequestMetrics"),
    "entrypoints/serve/engine/protocol.py": ("ModelCard", "ModelList", "UsageInfo"),
    "config/speculative.py": ("SpeculativeConfig",),
    "config/observability.py": ("ObservabilityConfig",),
    "config/vllm.py": ("VllmConfig",),
    "config/model.py": ("ModelConfig",),
}
# snapshot name -> (source file, "Class.method") whose returned dict literal and `result["k"] = ...` keys it holds
METHOD_DICTS = {"SpecDecodeMetricsDict": ("v1/metrics/stats.py", "RequestSpecDecodeMetrics.to_dict")}
# snapshot name -> (source file, the module-level `Name = Literal[...]` alias or "Class.field" annotated Literal)
LITERALS = {
    "DraftSampleMethod": ("config/speculative.py", "DraftSampleMethod"),
    "RejectionSampleMethod": ("config/speculative.py", "RejectionSampleMethod"),
    "PerRequestSpecDecodeMetrics": ("config/observability.py", "ObservabilityConfig.per_request_spec_decode_metrics"),
}
# snapshot name -> source file whose `@router.<method>("/path")` routes it lists as "METHOD /path"
ROUTES = {
    "SleepRoutes": "entrypoints/serve/dev/sleep/api_router.py",
    "BasicRoutes": "entrypoints/serve/instrumentator/basic.py",
    "HealthRoutes": "entrypoints/serve/instrumentator/health.py",
    "ServerInfoRoutes": "entrypoints/serve/dev/server_info/api_router.py",
}
# snapshot name -> (source file, function): the function's parameters (the sleep endpoint's query parameters)
PARAMETERS = {"SleepParameters": ("entrypoints/serve/dev/sleep/api_router.py", "sleep")}


def wheel_fields(package: Path) -> dict[str, list[str]]:
    """Every snapshot entry, read from a vLLM wheel's or checkout's `vllm` package directory."""
    package = Path(package)
    out: dict[str, list[str]] = {}
    for relative, classes in SOURCES.items():
        skip = class_variables(package / relative)  # pydantic's ClassVar caches are no fields
        out.update(
            {
                name: [f for f in fields if f not in skip]
                for name, fields in fields_from_source(package / relative, classes).items()
            }
        )
    for name, (relative, method) in METHOD_DICTS.items():
        out[name] = method_dict_keys(package / relative, method)
    for name, (relative, target) in LITERALS.items():
        out[name] = literal_values(package / relative, target)
    for name, relative in ROUTES.items():
        out[name] = routes(package / relative)
    for name, (relative, function) in PARAMETERS.items():
        out[name] = parameters(package / relative, function)
    return out


def _tree(source: Path) -> ast.Module:
    return ast.parse(Path(source).read_text(encoding="utf-8"))


def class_variables(source: Path) -> set[str]:
    """Names annotated `ClassVar[...]` in any class of `source` (class attributes, not model fields)."""
    return {
        s.target.id
        for cls in _tree(source).body
        if isinstance(cls, ast.ClassDef)
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and "ClassVar" in ast.unparse(s.annotation)
    }


def _method(tree: ast.Module, dotted: str) -> ast.FunctionDef:
    cls_name, name = dotted.split(".")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def method_dict_keys(source: Path, dotted: str) -> list[str]:
    """The string keys of the dict literals in method `dotted`, and of its `x["k"] = ...` stores, in source order."""
    keys: list[str] = []
    for node in ast.walk(_method(_tree(source), dotted)):
        if isinstance(node, ast.Dict):
            keys += [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif (
            isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant)
        ):
            keys.append(node.slice.value)
    return list(dict.fromkeys(keys))


def _literal(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [item.value for item in items if isinstance(item, ast.Constant)]
    raise ValueError(f"not a Literal[...]: {ast.unparse(node)}")


def literal_values(source: Path, target: str) -> list[str]:
    """The values of a `Name = Literal[...]` alias, or of a `Class.field: Literal[...]` annotation."""
    tree = _tree(source)
    if "." in target:
        cls_name, field = target.split(".")
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        node = next(
            s
            for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == field
        )
        return _literal(node.annotation)
    node = next(
        s
        for s in tree.body
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == target for t in s.targets)
    )
    return _literal(node.value)


def routes(source: Path) -> list[str]:
    """`METHOD /path` of every function decorated `@router.get/post(...)` in `source`, in source order."""
    out = []
    for node in _tree(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
                and deco.func.attr in ("get", "post", "put", "delete")
            ):
                out.append(f"{deco.func.attr.upper()} {deco.args[0].value}")
    return out


def parameters(source: Path, function: str) -> list[str]:
    """A module-level function's parameters, the request object (`raw_request`) aside."""
    node = next(
        n for n in _tree(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
    )
    return [a.arg for a in node.args.args if a.arg != "raw_request"]


PROTOCOL_FIELDS: dict[str, list[str]] = json.loads(SNAPSHOT.read_text(encoding="utf-8"))


def unknown_fields(body: dict, *models: str) -> list[str]:
    """Keys of a request or response body that none of vLLM's models `models` defines."""
    return sorted(set(body) - {name for model in models for name in PROTOCOL_FIELDS[model]})


def check_fields(body: dict, *models: str) -> dict:
    """`body`, after checking that vLLM's `models` define every key of it (ValueError naming the strays)."""
    unknown = unknown_fields(body, *models)
    if unknown:
        raise ValueError(f"fields {unknown} are not in vLLM {VERSION}'s {' / '.join(models)} ({SNAPSHOT.name})")
    return body
