"""docs/contracts.md's settings dicts agree with the schema they document (the stages' settings come from it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_eval import config as cfg

DOC = Path(__file__).resolve().parents[1] / "docs" / "contracts.md"


def _bullet(stage: str) -> str:
    section = DOC.read_text().split("## Settings dicts", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"^- {stage}: `\{{(.*?)(?=^- \w+: `\{{|\Z)", section, re.M | re.S)
    assert found, f"docs/contracts.md has no settings bullet for {stage}"
    return found.group(1).split("}`", 1)[0]  # the dict, not the notes on files after it


def _names(schema: dict) -> set[str]:
    """Every property name at any depth of a schema."""
    names = set()
    for key, sub in (schema.get("properties") or {}).items():
        names.add(key)
        if isinstance(sub, dict):
            names |= _names(sub)
    return names


@pytest.mark.parametrize("stage", ["server", "fetch", "extract", "evaluate", "profile_server"])
def test_every_setting_of_a_stage_is_documented_and_nothing_else(stage):
    schema = cfg.stage_schema(stage)
    quoted = set(re.findall(r'"(\w+)"', _bullet(stage)))
    assert set(schema["properties"]) <= quoted, f"undocumented: {sorted(set(schema['properties']) - quoted)}"
    values = {"managed", "external", "release", "completions", "chat", "final_norm", "pre_norm"}  # quoted values
    assert quoted - values <= _names(schema), f"documented but not settings: {sorted(quoted - values - _names(schema))}"
