"""How far each kind of expected speedup has been measured to be from a real one, shipped with the package.

benchmarks/speedup_validation.py sets the product's estimate beside the measured wall-clock speedup of a live loop
on the same device; what it found (measured / estimated per cell: above 1 the estimate is pessimistic) is kept in
speedup_validation.json beside this module, one entry per device x shape x method kind, with the identity of the
code that makes the estimate (provenance/identity.py's ESTIMATE_CODE: comments and docstrings do not count). The report prints the entries for each estimate's source and says whether they were
measured on this version of that code: an estimate is only as validated as the code it was validated on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.provenance.identity import estimate_code_hash

RECORD = Path(__file__).with_name("speedup_validation.json")
FORMAT = "dflash-eval speedup validation 1"
KEY = ("source", "device", "shape", "kind")  # an entry replaces the one with the same key


def code_hash() -> str:
    """The estimate code's identity (provenance.identity.ESTIMATE_CODE, hashed by the one rule): what an entry,
    a serving profile and a metrics.json are stamped with."""
    return estimate_code_hash()


def load(path: Path = RECORD) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise DflashEvalError(f"{path}: not a speedup validation record (format {FORMAT!r} with entries [])")
    return data["entries"]


def update(entries: list[dict[str, Any]], path: Path = RECORD) -> None:
    """Add `entries`, each replacing a recorded one of the same source, device, shape and kind."""
    new = {tuple(e[k] for k in KEY) for e in entries}
    kept = [e for e in load(path) if tuple(e[k] for k in KEY) not in new]
    atomic_write_json(path, {"format": FORMAT, "entries": kept + entries})


def entry(
    cells: list[dict[str, Any]], source: str, device: str, date: str, commit: str | None, record: str
) -> dict[str, Any]:
    """One entry from a benchmark's cells of one shape and kind ({"shape", "target", "kind", "ratio",
    "profile_method", "draft_method"} each)."""
    ratios = [float(c["ratio"]) for c in cells]
    first = cells[0]
    return {
        "source": source,
        "device": device,
        "date": date,
        "shape": first["shape"],
        "target": first["target"],
        "kind": first["kind"],
        "cells": len(ratios),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "profile_method": first["profile_method"],
        "draft_method": first["draft_method"],
        "estimate_code": code_hash(),
        "code_commit": commit,
        "record": record,
    }


def _stamps_line(entry_code: str, made_by: list[dict[str, Any]]) -> str:
    """Whether the numbers shown were made by the entry's estimate code, from their stamps (metrics.json's
    speedup.estimate_code: the evaluation's, and the measured profile's)."""
    codes = {
        (m or {}).get(part)
        for m in made_by
        for part in ("evaluation", "profile")
        if (m or {}).get(part) or part == "evaluation"
    }
    if not made_by or None in codes:
        return "these numbers carry no estimate-code stamp (made before stamps): not known to be this code"
    if codes == {entry_code}:
        return "the estimate code that made these numbers"
    others = ", ".join(sorted(codes - {entry_code}))
    return f"not the estimate code that made these numbers ({others})"


def describe(
    source: str, entries: list[dict[str, Any]] | None = None, made_by: list[dict[str, Any]] | None = None
) -> str:
    """A line for the summary: what was measured for estimates of `source`, and on which code. `made_by`: the
    estimate-code stamps of the numbers shown (each {"evaluation", "profile"}); None: this checkout's code."""
    entries = load() if entries is None else entries
    mine = [e for e in entries if e["source"] == source]
    if not mine:
        return (
            f"'{source}' estimates: not validated (no benchmark has set one beside a measured speedup; "
            "benchmarks/speedup_validation.py does it for our profile)"
        )
    current = code_hash()
    parts = []
    for e in mine:
        if made_by is not None:
            code = _stamps_line(e["estimate_code"], made_by)
        else:
            code = (
                "this version's estimate code"
                if e["estimate_code"] == current
                else (f"earlier estimate code ({e.get('code_commit') or e['estimate_code']}), not this version's")
            )
        parts.append(
            f"{e['device']} {e['date']}, {e['shape']} ({e['target']}) {e['kind']}: measured / estimated "
            f"{e['ratio_min']:.2f}-{e['ratio_max']:.2f} over {e['cells']} cells (target timed "
            f"{e['profile_method']}, drafter {e['draft_method']}; {code})"
        )
    return f"'{source}' estimates, validated ({mine[0]['record']}): " + "; ".join(parts)


def panel(
    sources: dict[str, list[dict[str, Any]]] | list[str], entries: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """trust.json's `speedup_validation`: per estimate source, the summary's line and the recorded entries, each
    with `this_code` (measured on the estimate code that made the numbers shown, by their stamps, when `sources`
    maps each source to them; else on this checkout's)."""
    entries = load() if entries is None else entries
    current = code_hash()
    stamped = sources if isinstance(sources, dict) else dict.fromkeys(sources)

    def same(entry: dict[str, Any], made_by: list[dict[str, Any]] | None) -> bool:
        if made_by is None:
            return entry["estimate_code"] == current
        return _stamps_line(entry["estimate_code"], made_by) == "the estimate code that made these numbers"

    return {
        "estimate_code": current,
        "sources": {
            source: {
                "summary": describe(source, entries, made_by),
                "entries": [{**e, "this_code": same(e, made_by)} for e in entries if e["source"] == source],
                **({"made_by": made_by} if made_by is not None else {}),
            }
            for source, made_by in stamped.items()
        },
    }
