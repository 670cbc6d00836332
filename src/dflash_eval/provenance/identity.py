"""Each stage's code identity: the modules it declares as deciding its outputs, hashed one way.

A stage reruns on code only when code that computes its files changes. Each stage declares the `dflash_eval` modules
whose logic decides what it writes (`decides`), those that only run it (`runs`: the command line, its settings, the
server's lifecycle, file I/O), and an output version bumped on purpose for a change the hash cannot see.
tests/provenance/test_identity.py fails on an import neither list names. Fetch's code is per engine
(`FETCH_ENGINES`; server.engine auto, detected when fetch runs, covers every engine).

The one hash rule (`modules_hash`; also the kept states' and the speedup estimate's key) hashes the stage's code, not
its file layout: the set of the declared modules' top-level statements, docstring-free and unparsed, sorted; an
import of another package counts once per name it binds, one from `dflash_eval` not at all (inside a function, with
`dflash_eval` as its source). Moving a function between declared modules, renaming a module whose users import its
names, splitting one, comments and formatting change nothing; a code change does. Blind to (bump the version): which
`dflash_eval` module a name is imported from (`from a import f` to `from b import f`, two different f's), the order
of top-level statements, a statement repeated in two declared modules. Code naming a module (`acceptance.f()`)
changes with its name. A Python upgrade may change the unparsed text and rerun each stage once.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from dflash_eval.provenance.fingerprint import FingerprintCache

PACKAGE = "dflash_eval"
PACKAGE_DIR = Path(__file__).resolve().parents[1]

# How every stage runs, whatever it computes: the command line, errors, settings, file helpers, provenance itself.
# (`checkpoint`: the settings read a drafter's layer list through it; evaluation and the report declare it deciding.)
COMMON_RUNS = (
    "cli",
    "commands",
    "config",
    "drafters",
    "checkpoint",
    "errors",
    "io_utils",
    "yaml_files",
    "provenance.*",
)
# The server's lifecycle around fetch and extraction: like the server settings (docs/reruns.md) it reruns nothing.
SERVER_RUNS = ("server.*",)

# The modules whose code decides the hidden states' values (the forward, its hooks, the kernels, the loading):
# also the kept states' code key (cache/reuse.py), so a change of them recomputes states rather than copying them.
STATE_CODE = ("extract.capture", "extract.backends", "extract.target")
# The code that makes the expected speedup: the target's step timing (the profile_target rule's), the drafter's
# (evaluation's), the formula (the report's). The validation record (speedup/validation.py) is stamped with its
# hash; a profile and a metrics.json are too.
ESTIMATE_CODE = (
    "tools.target_timing",
    "speedup.model",
    "speedup.timing",
    "speedup.forwards.*",
    "evaluate.draft_timing",
    "evaluate.speedup",
    "report.speedup",
)
# The target's step timing alone: the profile_target rule's, with the target's loading and kernels (STATE_CODE's).
TARGET_TIMING_CODE = (
    "tools.profile_target",
    "tools.target_timing",
    "speedup.timing",
    "speedup.forwards.target",
    "speedup.forwards.hybrid_target",
    "speedup.forwards.graphs",
    "extract.backends",
    "extract.target",
    "target_identity",
    "stats",
)
# Imported by extraction only for extract.backends' GdnKernels type (its gdn_kernels serves the target's timing,
# tools/target_timing.py): no hidden state depends on them. (The live loops, speedup/live_loops/, are imported by no
# stage: tests/provenance/test_identity.py checks it.)
STATIC_TIMING = ("speedup.forwards", "speedup.forwards.hybrid_target", "speedup.forwards.target")


@dataclass(frozen=True)
class StageCode:
    """What decides a stage's outputs (`decides`), what only runs it (`runs`), and the output version, bumped on
    purpose. A name is a module (`speedup` is the package's __init__ alone) or, ending in `.*`, a whole package."""

    decides: tuple[str, ...]
    runs: tuple[str, ...]
    version: int = 1


_EVALUATE_DECIDES = (
    "evaluate.stage",
    "evaluate.acceptance",
    "evaluate.all_anchor",
    "evaluate.blocks",
    "evaluate.ddtree",
    "evaluate.drafter",
    "evaluate.drafter_model",
    "evaluate.packed",
    "evaluate.rejection",
    "evaluate.rejection_metrics",
    "evaluate.sampled_check",
    "evaluate.drafter_kind",
    "evaluate.target_head",
    "evaluate.trajectory",
    "evaluate.draft_timing",
    "evaluate.speedup",
    "attention_layout",
    "checkpoint",
    "checkpoint_weights",
    "methods",
    "stats",
    "cache.sampling",
    "speedup.model",
    "speedup.labels",
    "speedup.timing",
    "speedup.forwards.target",
    "speedup.forwards.drafter",
    "speedup.forwards.tree_step",
    "speedup.forwards.graphs",
)
_EXTRACT_DECIDES = (
    *STATE_CODE,
    "extract.stage",
    "extract.layers",
    "extract.positions",
    "extract.target_logprobs",
    "cache.manifest",
    "cache.store",
    "cache.writer",
    "cache.sampling",
    "target_identity",
    "stats",
)
# Files read back, checked or resumed: their checks stop a wrong run, they do not change a right one's numbers.
_CACHE_READERS = (
    "cache",
    "cache.completions_check",
    "cache.resume",
    "cache.reuse",
    "cache.verify",
    "cache.serving_profile",
    "cache.manifest",
    "cache.store",
    "cache.writer",
    "completions",
    "target_identity",
)

# fetch's code for every engine, and each engine's own: a record is parsed by the code of the engine that served it.
_FETCH_DECIDES = ("fetch.sampling", "fetch.presets", "fetch.prompts", "completions")
FETCH_ENGINES: dict[str, tuple[str, ...]] = {
    "sglang": ("fetch.sglang", "sglang_protocol"),
    "vllm": ("fetch.vllm", "vllm_protocol"),
    "openai": ("fetch.sglang", "sglang_protocol"),  # a plain OpenAI-compatible answer is read by SGLang's parser
}
# server.engine: auto is detected from the server when fetch runs, after the plan: its identity covers every engine.
AUTO = "auto"

STAGES: dict[str, StageCode] = {
    "fetch": StageCode(
        decides=(*_FETCH_DECIDES, *sorted({m for code in FETCH_ENGINES.values() for m in code})),
        runs=(*COMMON_RUNS, *SERVER_RUNS, "fetch.stage", "fetch.retry", "fetch.store", "fetch.settings"),
    ),
    "extract": StageCode(
        decides=_EXTRACT_DECIDES,
        # methods: the scheme names extract.settings reads evaluation.verify by
        runs=(
            *COMMON_RUNS,
            *SERVER_RUNS,
            *_CACHE_READERS,
            *STATIC_TIMING,
            "extract.settings",
            "methods",
        ),
    ),
    "evaluate": StageCode(
        decides=_EVALUATE_DECIDES,
        runs=(
            *COMMON_RUNS,
            *_CACHE_READERS,
            "evaluate.command",
            "evaluate.settings",
            "evaluate.several",
            "evaluate.result_store",
            "evaluate.gpu",
            "evaluate.cuda_graphs",
            "evaluate.transfer",
        ),
    ),
    "report": StageCode(
        decides=(
            "report.*",
            "attention_layout",
            "methods",
            "stats",
            "completions",
            "speedup.labels",
            "speedup.model",
            "speedup.validation",
            "checkpoint",
            "checkpoint_weights",
            "cache.serving_profile",
            "cache.manifest",
        ),
        runs=(*COMMON_RUNS, "cache", "speedup"),
    ),  # two packages' __init__ (docstrings)
    "compare-backends": StageCode(
        decides=("tools.compare_backends", *_EXTRACT_DECIDES, *_EVALUATE_DECIDES),
        runs=(
            *COMMON_RUNS,
            *SERVER_RUNS,
            *_CACHE_READERS,
            *STATIC_TIMING,
            "evaluate.*",
            "extract.settings",
        ),
    ),
    "export": StageCode(
        decides=("report.export", "report.speculation_profile", "stats", "methods", "completions", "cache.manifest"),
        runs=(*COMMON_RUNS, "cache"),
    ),  # the package's __init__ (a docstring)
    "profile-target": StageCode(
        decides=TARGET_TIMING_CODE,
        runs=(
            *COMMON_RUNS,
            *SERVER_RUNS,
            "cache",
            "cache.serving_profile",
            "extract",
            "tools",
            "speedup",
        ),
    ),
    "profile-server": StageCode(
        decides=("tools.profile_server", "cache.serving_profile", "speedup.labels", "stats", "completions"),
        runs=(*COMMON_RUNS, *SERVER_RUNS),
    ),
}


def module_path(dotted: str) -> Path:
    """The file of `dflash_eval.<dotted>` (a module, or a package's __init__)."""
    relative = Path(*dotted.split("."))
    for candidate in (PACKAGE_DIR / relative.with_suffix(".py"), PACKAGE_DIR / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise KeyError(f"{PACKAGE}.{dotted}: no such module under {PACKAGE_DIR} (a declared module that moved?)")


def package_modules(declared: str) -> tuple[str, ...]:
    """The modules a declared name covers: the module itself, or for `package.*` the package and every module
    below it."""
    if not declared.endswith(".*"):
        module_path(declared)
        return (declared,)
    package = declared[:-2]
    root = module_path(package).parent
    below = sorted(p.relative_to(PACKAGE_DIR).with_suffix("") for p in root.rglob("*.py"))
    return tuple(".".join(p.parts[:-1] if p.name == "__init__" else p.parts) for p in below)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def module_code(dotted: str) -> str:
    """A module's code as it runs: its syntax tree without docstrings, unparsed (no comments, one formatting)."""
    return ast.unparse(_without_docstrings(ast.parse(module_path(dotted).read_text())))


def _internal(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or node.module == PACKAGE or (node.module or "").startswith(PACKAGE + ".")
    return any(alias.name == PACKAGE or alias.name.startswith(PACKAGE + ".") for alias in node.names)


def _one_name(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> ast.stmt:
    """The import of one of the names `node` binds: a split module importing the same names twice counts once."""
    return ast.Import([alias]) if isinstance(node, ast.Import) else ast.ImportFrom(node.module, [alias], node.level)


def _statements(path: str) -> list[str]:
    """A module's top-level statements as they count in an identity, docstring-free and unparsed: an import of
    another package one statement per name it binds, an import from `dflash_eval` left out (inside a function or a
    block it is kept, its source module replaced by the package's name)."""
    tree = _without_docstrings(ast.parse(Path(path).read_text()))
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not _internal(node):
                found.extend(ast.unparse(_one_name(node, alias)) for alias in node.names)
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Import, ast.ImportFrom)) and _internal(inner):
                if isinstance(inner, ast.ImportFrom):
                    inner.module, inner.level = PACKAGE, 0
                else:
                    inner.names = [ast.alias(PACKAGE, a.asname) for a in inner.names]
        found.append(ast.unparse(node))
    return found


def _statement_digests(path: str) -> str:
    """What is kept per file: the sha256 of each of its counted statements, sorted, one a line."""
    return "\n".join(sorted({hashlib.sha256(s.encode()).hexdigest() for s in _statements(path)}))


# Parsing and unparsing every declared module takes seconds on a slow machine, and the Snakefile is parsed by
# every Snakemake process (cluster jobs too): each module's statement digests are kept by path, size and mtime.
_CODE_DIGESTS = FingerprintCache(Path(".snakemake") / "dflash-eval" / "code_statements.json", digest=_statement_digests)


def declared_modules(modules: tuple[str, ...]) -> list[str]:
    """Every module the declared names cover, sorted."""
    return sorted({m for declared in modules for m in package_modules(declared)})


def modules_hash(modules: tuple[str, ...], version: int = 1) -> str:
    """The one hash rule: sha256 over the output version and the set of the declared modules' counted top-level
    statements (`_statements`), sorted, whatever module holds each. `sha256:` and the first 16 hex digits."""
    statements: set[str] = set()
    for name in declared_modules(modules):
        statements.update(_CODE_DIGESTS.file(module_path(name), name).split())
    digest = hashlib.sha256(f"version {version}\n".encode())
    for statement in sorted(statements):
        digest.update(f"{statement}\n".encode())
    return "sha256:" + digest.hexdigest()[:16]


def decided_by(stage: str, engine: str = AUTO) -> tuple[str, ...]:
    """The modules that decide `stage`'s outputs; for fetch, with server.engine `engine`, that engine's own
    (FETCH_ENGINES; every engine's for auto)."""
    if stage not in STAGES:
        raise KeyError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    if stage != "fetch" or engine == AUTO:
        return STAGES[stage].decides
    if engine not in FETCH_ENGINES:
        raise KeyError(f"server.engine {engine!r}: one of {AUTO}, {', '.join(FETCH_ENGINES)}")
    return (*_FETCH_DECIDES, *FETCH_ENGINES[engine])


@functools.cache
def stage_identity(stage: str, engine: str = AUTO) -> str:
    """The code identity of a stage's outputs, `<stage>.v<version>.sha256:<16 hex>`: its declared modules (fetch's
    for server.engine `engine`, `decided_by`) and output version, hashed by the one rule. No spaces: the workflow
    puts it in each rule's shell command, where Snakemake's own `code` rerun trigger compares it (docs/reruns.md)."""
    decides = decided_by(stage, engine)
    version = STAGES[stage].version
    return f"{stage}.v{version}.{modules_hash(decides, version)}"


def state_code_hash() -> str:
    """The kept states' code key: STATE_CODE hashed by the one rule."""
    return modules_hash(STATE_CODE)


def estimate_code_hash() -> str:
    """The speedup estimate's code key: ESTIMATE_CODE hashed by the one rule."""
    return modules_hash(ESTIMATE_CODE)
