"""Reading the YAML files users write (config.yaml, every --configfile), refusing what YAML would hide.

PyYAML, like Snakemake's own loader, keeps the last of two equal keys in a mapping: a copy-pasted
drafter block silently replaces the drafter above it, and its result with it. Here a repeated key is
an error naming the file, both lines and the key's place in the document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dflash_eval.errors import DflashEvalError


class DuplicateKeyError(DflashEvalError):
    """A mapping of a YAML file holds the same key twice."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with a repeated key, and remembers the file for the message."""

    source = "<yaml>"

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges are YAML's own way to repeat keys on purpose
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"{self.source}:{line}: key {key!r} appears twice in one mapping (first at line {seen[key]}); "
                    "YAML would keep only the second silently. Rename one (a copied drafter or dataset block "
                    "needs a name of its own) or delete the copy"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """The document of a YAML file; a repeated key or a syntax error is an error naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DflashEvalError(f"{path}: cannot be read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise DflashEvalError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8"
        ) from None
    loader = _StrictLoader(text)
    loader.source = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        hint = (
            " (YAML indents with spaces, never tabs: replace the tab there with spaces)"
            if "'\\t'" in str(error)
            else ""
        )
        raise DflashEvalError(f"{where}: not valid YAML: {getattr(error, 'problem', None) or error}{hint}") from None
    finally:
        loader.dispose()
