"""Evaluation's part of the expected speedup: the drafter's step, timed at the rows each block's step projects."""

from dflash_eval.evaluate import speedup
from dflash_eval.provenance import identity


def _method(kind, size, tau):
    return {
        "kind": kind,
        "block_size": 16 if kind == "ddtree" else size,
        "budget": size if kind == "ddtree" else None,
        "tau_token_weighted": tau,
    }


def test_the_drafter_is_timed_at_each_block_and_budget_with_the_rows_its_step_projects():
    methods = {
        "chain-B16": _method("chain", 16, 5.0),
        "ddtree-16": _method("ddtree", 16, 6.4),
        "chain-B4": _method("chain", 4, float("nan")),
    }
    asked = []
    section = speedup.drafter_section(methods, lambda blocks, trees: asked.append((blocks, trees)) or {"t": 1})
    # block 16, projecting round(tau) = 5 new context rows per step; the DDTree's step round(6.4) = 6; a nan tau: 1
    assert asked == [({4: 1, 16: 5}, {16: 6})]
    assert section["draft_timing"] == {"t": 1}
    assert section["estimate_code"] == {"evaluation": identity.estimate_code_hash()}
    assert "expected_speedup" not in methods["chain-B16"]  # the report makes the estimate, not evaluation
