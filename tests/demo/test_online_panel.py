"""The demo's online-vs-offline panel, filled: the demo server's own counters against our offline steps.

The demo's server (src/dflash_eval/demo/server.py) speculates with the served drafter in fp32 on the CPU, as
the offline side does, so per request its verification steps, completion tokens and accepted drafts must equal
ours, apart from floating-point near-ties (tests/demo/test_offline_reference_loop.py allows them at the same rate).
Needs the demo run (`snakemake --cores 2`), so it is marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_demo_summary_sets_the_servers_counters_beside_ours():
    trust, summary = REPO / "results" / "trust.json", REPO / "results" / "summary.md"
    if not trust.exists():
        pytest.skip("run the demo first: snakemake --cores 2")
    online = json.loads(trust.read_text())["online"]["demo-code"]
    assert online["recorded"] and online["compared"], online
    assert online["drafter"] == "demo-step900-pt" and online["method"] == "chain-B8"
    assert online["samples_compared"] == online["samples_with_stats"] == 59
    assert online["equal_requests"] >= 0.9 * online["samples_compared"], online["unequal_ids"]
    assert not online["beyond_tolerance"]
    row = next(line for line in summary.read_text().splitlines() if line.startswith("| demo-code | demo-step900-pt |"))
    assert f"{online['equal_requests']} of 59" in row
    print(row)
