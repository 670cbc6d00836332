"""docs/configuration.md, written from config.schema.yaml: every key of config.yaml with its type, default and
meaning, so that no page restates a default by hand.

`python -m dflash_eval.tools.config_reference [--out FILE]` writes it (stdout without --out); `--check FILE` exits 1
when FILE is not what the schema gives now."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

SCHEMA_FILE = "config.schema.yaml"  # package data of dflash_eval
GENERATOR = "python -m dflash_eval.tools.config_reference --out docs/configuration.md"
NAME = "<name>"  # the key part of a map of user-named entries (datasets, drafters)

HEADER = f"""# Configuration reference

Every key of `config.yaml`, with its values, its default and what it does. This page is generated from
`src/dflash_eval/config.schema.yaml`, the one place a default is defined: do not edit it by hand. After a schema
change, run `{GENERATOR}`.
"""


def load_schema() -> dict:
    """The schema as shipped with the package (a wheel install has it too)."""
    return yaml.safe_load(resources.files("dflash_eval").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`" if text != "" else '`""`'


def _bounds(schema: dict) -> str:
    parts = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in schema:
            parts.append(f"{sign} {schema[key]}")
    if "not" in schema and "const" in schema["not"]:
        parts.append(f"not {schema['not']['const']}")
    if "minItems" in schema:
        parts.append(f"at least {schema['minItems']} item{'s' if schema['minItems'] > 1 else ''}")
    if schema.get("uniqueItems"):
        parts.append("no repeats")
    if "pattern" in schema:
        parts.append(f"matching `{schema['pattern']}`")
    return ", ".join(parts)


def describe(schema: dict) -> str:
    """A key's allowed values in words: `integer >= 1`, one of `a`, `b`, `array of integer >= 2` or `all`."""
    if "oneOf" in schema:
        return " or ".join(describe(option) for option in schema["oneOf"])
    if "const" in schema:
        return _code(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(_code(value) for value in schema["enum"])
    types = schema.get("type", "any")
    types = types if isinstance(types, list) else [types]
    words = []
    for kind in types:
        if kind == "array" and "items" in schema:
            words.append(f"array of {describe(schema['items'])}")
        else:
            words.append(kind)
    bounds = _bounds(schema)
    return " or ".join(words) + (f", {bounds}" if bounds else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(schema: dict, prefix: str) -> list[tuple[str, dict, bool]]:
    """(dotted key, its schema, required) for every leaf under an object schema, in the schema's order."""
    out = []
    required = set(schema.get("required", ()))
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}.{name}" if prefix else name
        if sub.get("type") == "object" and ("properties" in sub or isinstance(sub.get("additionalProperties"), dict)):
            out += rows(sub, key) if "properties" in sub else rows(sub["additionalProperties"], f"{key}.{NAME}")
        else:
            out.append((key, sub, name in required))
    return out


def _table(entries: list[tuple[str, dict, bool]]) -> list[str]:
    lines = ["| key | values | default | meaning |", "|---|---|---|---|"]
    for key, sub, required in entries:
        default = _code(sub["default"]) if "default" in sub else ("required" if required else "none")
        lines.append(f"| `{key}` | {_cell(describe(sub))} | {_cell(default)} | {_cell(sub.get('description', ''))} |")
    return lines


def render(schema: dict) -> str:
    """The whole page: one section per top-level key, in the schema's order."""
    lines = [HEADER]
    required = set(schema.get("required", ()))
    for name, sub in schema["properties"].items():
        lines.append(f"## {name}")
        lines.append("")
        nested = sub.get("additionalProperties")
        words = [sub.get("description", "")]
        if name in required:
            words.append("Required.")
        if isinstance(nested, dict):
            words.append(
                f"A map: each entry is named by you (`{name}.{NAME}`)"
                + (f"; {nested['description']}." if nested.get("description") else ".")
            )
        text = " ".join(word[0].upper() + word[1:] if word else word for word in words if word).strip()
        if text:
            lines += [text if text.endswith(".") else text + ".", ""]
        if "properties" in sub:
            entries = rows(sub, name)
        elif isinstance(nested, dict):
            entries = rows(nested, f"{name}.{NAME}")
        else:
            entries = [(name, sub, name in required)]
        lines += _table(entries) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_eval.tools.config_reference", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out", type=Path, help="write the page here (default: stdout)")
    group.add_argument("--check", type=Path, help="exit 1 if this file is not the page the schema gives")
    args = parser.parse_args(argv)
    page = render(load_schema())
    if args.check:
        if not args.check.is_file() or args.check.read_text(encoding="utf-8") != page:
            print(f"{args.check} is not what {SCHEMA_FILE} gives: run `{GENERATOR}`", file=sys.stderr)
            return 1
        return 0
    if args.out:
        args.out.write_text(page, encoding="utf-8")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
