"""docs/configuration.md is what config.schema.yaml gives, and its defaults are the ones the loader fills in."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dflash_eval.config import validate_config
from dflash_eval.tools import config_reference as ref

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([^`]+)` \| (.*) \| (.*) \| (.*) \|$")
MINIMAL = {
    "target": {"path": "t"},
    "server": {"kind": "managed", "base_url": "http://127.0.0.1:1", "command": "true"},
    "fetch": {},
    "datasets": {"d": {"prompts": "p.jsonl"}},
    "extraction": {},
    "evaluation": {},
    "drafters": {"a": {"path": "ckpt"}},
}


def page_rows() -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2], m[3]) for line in PAGE.read_text().splitlines() if (m := ROW.match(line))}


def leaves(config: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value of a filled config, the user-named entries (datasets, drafters) as <name>."""
    out = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if prefix in ("datasets", "drafters"):
            dotted = f"{prefix}.{ref.NAME}"
        if isinstance(value, dict) and value and key != "chat_template_kwargs":
            out.update(leaves(value, dotted))
        else:
            out[dotted] = value
    return out


def test_the_page_is_what_the_schema_gives():
    assert ref.main(["--check", str(PAGE)]) == 0, f"run `{ref.GENERATOR}`"


def test_a_stale_page_fails_the_check(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(PAGE.read_text().replace("`2048`", "`4096`", 1))
    assert ref.main(["--check", str(stale)]) == 1
    assert "run `python -m dflash_eval.tools.config_reference --out docs/configuration.md`" in capsys.readouterr().err


def test_every_default_is_the_one_the_loader_fills_in():
    """Against the loader (config.validate_config), not the generator's own walk: each key the loader fills into a
    minimal config is on the page with that value, and no key on the page claims a default the loader does not give."""
    filled = leaves(validate_config(yaml.safe_load(yaml.safe_dump(MINIMAL)), "config.yaml"))
    given = leaves(MINIMAL)
    rows = page_rows()
    assert set(filled) <= set(rows), sorted(set(filled) - set(rows))
    for key, value in filled.items():
        if key not in given:
            assert yaml.safe_load(rows[key][1].strip("`")) == value, (key, rows[key][1], value)
    for key, (_, default) in rows.items():
        if default not in ("required", "none"):
            assert key in filled, f"{key}: the page gives default {default}, the loader fills in none"
    assert len(rows) > 80  # every key of the schema (the preset key of a dataset has no default)


def test_values_in_words_by_hand():
    assert ref.describe({"type": "integer", "minimum": 1}) == "integer, >= 1"
    assert ref.describe({"type": ["string", "null"]}) == "string or null"
    assert ref.describe({"enum": ["a", "b"]}) == "one of `a`, `b`"
    assert (
        ref.describe({"oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 2}}, {"const": "all"}]})
        == "array of integer, >= 2 or `all`"
    )
    assert ref.describe({"type": "integer", "minimum": -1, "not": {"const": 0}}) == "integer, >= -1, not 0"
