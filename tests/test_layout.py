"""What the tests share lives in tests/support/ (or dflash_eval.testing, with the benchmarks): no test module, conftest
or helper imports another test module, so that moving or deleting a test breaks no other."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(path: Path) -> list[str]:
    """The `tests.` modules that `path` imports, at any depth (function-level imports count)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.append("." * node.level + (node.module or ""))  # relative: never another test module here
    return [name for name in names if name == "tests" or name.startswith(("tests.", "."))]


def test_no_test_imports_another_test_module():
    wrong = {
        str(path.relative_to(TESTS.parent)): bad
        for path in sorted(TESTS.rglob("*.py"))
        if (bad := [name for name in imported_test_modules(path) if not name.startswith("tests.support")])
    }
    assert not wrong, f"move what these import into tests/support/ (or dflash_eval.testing): {wrong}"


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    source = tmp_path / "test_x.py"
    source.write_text(
        "def f():\n    from tests.fetch.test_sglang import served\nimport tests.fetch.conftest\n"
        "from tests.support.tiny import VOCAB\nfrom . import helper\n"
    )
    assert sorted(imported_test_modules(source)) == [
        ".",
        "tests.fetch.conftest",
        "tests.fetch.test_sglang",
        "tests.support.tiny",
    ]
