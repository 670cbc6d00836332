"""Evaluation methods (methods.py): names, parsing, the kind registry, verified tokens, order and labels."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_eval import methods
from dflash_eval.errors import DflashEvalError
from dflash_eval.methods import chain_method, tree_method


def test_names_by_hand():
    assert chain_method(8) == "chain-B8" and chain_method(16) == "chain-B16"
    assert tree_method(1) == "ddtree-1" and tree_method(1024) == "ddtree-1024"
    assert methods.name("chain", 4) == "chain-B4" and methods.name("ddtree", 32) == "ddtree-32"
    assert chain_method(np.int64(6)) == "chain-B6"  # sizes that come from numpy arrays


@pytest.mark.parametrize(
    "name, kind, parameter, verified, block_size, budget",
    [
        ("chain-B2", "chain", 2, 2, 2, None),  # a chain block of b verifies b tokens
        ("chain-B16", "chain", 16, 16, 16, None),
        ("ddtree-8", "ddtree", 8, 9, 16, 8),  # a tree of N nodes verifies N + 1 (the root), drafted from B
        ("ddtree-1024", "ddtree", 1024, 1025, 16, 1024),
    ],
)
def test_parse_by_hand(name, kind, parameter, verified, block_size, budget):
    parsed = methods.parse(name)
    assert (parsed.kind.name, parsed.parameter, parsed.name) == (kind, parameter, name)
    assert parsed.verified_tokens == methods.verified_tokens(name) == verified
    assert parsed.block_size(16) == block_size and parsed.budget == budget
    assert methods.is_kind(name, kind) and not methods.is_kind(name, "ddtree" if kind == "chain" else "chain")


def test_report_order_is_kinds_then_parameter_not_text():
    names = ["ddtree-16", "chain-B4", "ddtree-8", "chain-B16", "chain-B2", "ddtree-128"]
    assert sorted(names, key=methods.sort_key) == [
        "chain-B2",
        "chain-B4",
        "chain-B16",
        "ddtree-8",
        "ddtree-16",
        "ddtree-128",
    ]


def test_main_table_shows_the_own_chain_and_every_tree():
    assert methods.in_main_table("chain-B4", primary=True)
    assert not methods.in_main_table("chain-B2", primary=False)
    assert methods.in_main_table("ddtree-8", primary=False)


def test_report_labels():
    """The legends summary.md prints, word for word."""
    assert methods.legend() == (
        "`chain-B<n>`: chain drafting with block size n (the drafter's own B here); "
        "`ddtree-<N>`: DDTree with N nodes besides the root"
    )
    assert methods.verified_legend() == "b tokens verified for `chain-B<b>` and N + 1 for `ddtree-<N>`"


@pytest.mark.parametrize(
    "name",
    [
        "chain-8",
        "chainB8",
        "chain-B",
        "chain-B0",
        "chain-B08",
        "chain-B-2",
        "chain-B2.0",
        "ddtree-",
        "ddtree-x",
        "ddtree-08",
        "ddtree- 8",
        "ddtree-8 ",
        "DDTree-8",
        "beam-4",
        "",
        "target-only",
    ],
)
def test_unparsable_names_are_errors_naming_them(name):
    with pytest.raises(DflashEvalError, match=f"evaluation method {name!r} is not one this version knows"):
        methods.parse(name)
    with pytest.raises(DflashEvalError, match="method names are chain-B<n>, ddtree-<N>"):
        methods.verified_tokens(name)
    with pytest.raises(DflashEvalError):
        methods.sort_key(name)


def test_a_name_that_is_not_text_is_an_error():
    with pytest.raises(DflashEvalError, match="evaluation method 8 is not"):
        methods.parse(8)  # type: ignore[arg-type]


def test_unknown_kinds_and_bad_parameters_are_errors():
    with pytest.raises(DflashEvalError, match="unknown evaluation method kind 'beam'; the kinds are chain, ddtree"):
        methods.name("beam", 4)
    with pytest.raises(DflashEvalError, match="unknown evaluation method kind 'beam'"):
        methods.is_kind("chain-B4", "beam")
    for bad in (0, -1):
        with pytest.raises(DflashEvalError, match=r"chain-B<n>: its parameter must be >= 1"):
            chain_method(bad)
    for bad in (2.0, "4", True, None):
        with pytest.raises(DflashEvalError, match=r"ddtree-<N>: its parameter must be an integer"):
            tree_method(bad)  # type: ignore[arg-type]


def test_a_registered_kind_is_named_parsed_and_ordered(monkeypatch):
    """Adding a kind is one registry entry: names, parsing, verified tokens and order follow from it."""
    scheme = methods.Kind(
        name="target-only",
        prefix="target-only-B",
        placeholder="b",
        describe="the target alone",
        verified=lambda block: block,
        verified_text="b for `target-only-B<b>`",
        block_size=lambda block, _drafter: block,
        budget=lambda _block: None,
        every_in_main_table=True,
    )
    monkeypatch.setitem(methods.KINDS, scheme.name, scheme)
    name = methods.name("target-only", 4)
    assert name == "target-only-B4" and methods.parse(name).kind is scheme and methods.verified_tokens(name) == 4
    assert sorted(["target-only-B4", "ddtree-8", "chain-B4"], key=methods.sort_key) == [
        "chain-B4",
        "ddtree-8",
        "target-only-B4",
    ]
    assert methods.verified_legend() == (
        "b tokens verified for `chain-B<b>`, N + 1 for `ddtree-<N>` and b for `target-only-B<b>`"
    )


def test_every_method_the_evaluate_stage_names_round_trips():
    """The trajectory evaluator's names (metrics.json's methods, samples.csv's method) and the stage's
    per-method fields: each name parses back to its kind and parameter and is spelled the same."""
    from dflash_eval.evaluate.blocks import BlockDrafter
    from dflash_eval.evaluate.stage import method_metrics, requested_block_sizes
    from dflash_eval.evaluate.trajectory import TrajectoryEvaluator
    from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

    block = 6
    target = tiny_target(seed=0)
    runner = BlockDrafter(
        tiny_drafter([0, 2], block_size=block, window=5),
        target.model.embed_tokens.weight.detach(),
        target.lm_head.weight.detach(),
        MASK_ID,
    )
    budgets = [1, 2, 8, 1024]
    evaluator = TrajectoryEvaluator(runner, {1}, block_sizes=requested_block_sizes("all", block), budgets=budgets)
    assert evaluator.names == [f"chain-B{b}" for b in range(2, block + 1)] + [f"ddtree-{n}" for n in budgets]
    for name in evaluator.names:
        parsed = methods.parse(name)
        assert methods.name(parsed.kind.name, parsed.parameter) == name
        fields = method_metrics(name, [[2, 1], [3]], block, {"bootstrap": 0, "seed": 0})
        assert (fields["method"], fields["kind"]) == (name, parsed.kind.name)
        assert (fields["block_size"], fields["budget"]) == (parsed.block_size(block), parsed.budget)
    assert evaluator.names[evaluator.primary] == chain_method(block)


def test_the_verification_schemes_are_the_schemas():
    """methods.SCHEMES names evaluation.verify's values (the schema's enum), target_only first (its default)."""
    from dflash_eval import config
    from dflash_eval.methods import REJECTION, SCHEMES, TARGET_ONLY

    verify = config.stage_schema("evaluate")["properties"]["verify"]
    assert verify["oneOf"][0]["enum"] == list(SCHEMES) == [TARGET_ONLY, REJECTION]
    assert verify["default"] == TARGET_ONLY
