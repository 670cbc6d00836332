"""Which `dflash_eval` modules each stage imports, transitively: what its declared code identity must cover.

A stage's code identity (provenance/identity.py) hashes only the modules it declares as deciding its outputs;
tests/provenance/test_identity.py checks with this closure that every module a stage imports is declared there,
either as deciding its outputs or as how it runs, so a new import cannot slip past the rerun decision.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from dflash_eval.commands import COMMANDS

PACKAGE = "dflash_eval"
PACKAGE_DIR = Path(__file__).resolve().parents[1]

# stage -> the module that `dflash-eval <stage>` runs (commands.py names the modules, importing none)
STAGE_MODULES = {stage: module[len(PACKAGE) + 1 :] for stage, (module, *_rest) in COMMANDS.items()}


def _module_path(dotted: str) -> Path | None:
    """File of `dflash_eval.<dotted>` (module or package __init__), None if it is not ours."""
    relative = Path(*dotted.split("."))
    for candidate in (PACKAGE_DIR / relative.with_suffix(".py"), PACKAGE_DIR / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path) -> list[str]:
    return list(path.relative_to(PACKAGE_DIR).parent.parts)


# `from X import names` (names may be a parenthesized list over lines) and `import dflash_eval.X`
_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)|import[ \t]+(dflash_eval\.[.\w]+))", re.M
)


def _imports(path: Path, source: str) -> set[str]:
    """`dflash_eval` modules imported by one file (also inside functions), relative to the package.

    A regular expression rather than `ast`: parsing every module costs seconds on a slow
    machine, and the Snakefile is parsed again by every cluster job.
    """
    found: set[str] = set()
    for origin, names, plain in _IMPORT.findall(source):
        if plain:
            found.add(plain[len(PACKAGE) + 1 :])
            continue
        if origin.startswith("."):
            level = len(origin) - len(origin.lstrip("."))
            package = _package_of(path)
            prefix = package[: len(package) - (level - 1)] + [p for p in origin.lstrip(".").split(".") if p]
        elif origin == PACKAGE or origin.startswith(PACKAGE + "."):
            prefix = origin.split(".")[1:]
        else:
            continue
        for name in re.findall(r"\w+", names.split("#")[0] if not names.startswith("(") else names):
            if name == "as":
                continue
            candidate = ".".join(prefix + [name])  # `from . import acceptance` names a module
            found.add(candidate if _module_path(candidate) else ".".join(prefix))
    return {name for name in found if name and _module_path(name)}


@functools.cache
def stage_modules(stage: str) -> tuple[str, ...]:
    """The stage's module and its transitive `dflash_eval` imports, sorted."""
    if stage not in STAGE_MODULES:
        raise KeyError(f"unknown stage {stage!r}; one of {', '.join(STAGE_MODULES)}")
    seen: set[str] = set()
    todo = [STAGE_MODULES[stage]]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_path(name)
        todo.extend(_imports(path, path.read_text()) - seen)
    return tuple(sorted(seen))
