"""Evaluation methods: the one place that names them, reads their names back and knows what each kind means.

A method is a kind and one integer parameter, named `<prefix><parameter>`:

    chain-B<b>    chain drafting with block size b; the target verifies b tokens per step
    ddtree-<N>    DDTree with N nodes besides the root, drafted from the drafter's own block; N + 1 verified

The verification schemes (`target_only`, `rejection`) are named here too. The evaluate stage names its methods here (metrics.json's `methods` keys, samples.csv's `method`), the
speedup model asks here how many tokens a step verifies, and the report asks here for their order and
labels. Adding a kind is one `Kind` entry in KINDS (and its case in tests/test_methods.py); a name that no
kind parses, or an unknown kind, is an error naming it, never a guess.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from dflash_eval.errors import DflashEvalError


@dataclass(frozen=True)
class Kind:
    """One kind of method: how its name is spelled, what its parameter is and what a step of it costs."""

    name: str  # metrics.json's `kind`
    prefix: str  # the method's name is prefix + parameter
    placeholder: str  # the parameter's letter in the report's legend
    describe: str  # the legend: what the method is, in terms of the placeholder
    verified: Callable[[int], int]  # parameter -> tokens the target verifies per step
    verified_text: str  # the same, for the report's formula, in terms of the placeholder
    block_size: Callable[[int, int], int]  # (parameter, drafter's block) -> tokens of the drafted block
    budget: Callable[[int], int | None]  # parameter -> metrics.json's `budget` (None: no tree)
    every_in_main_table: bool  # False: only the drafter's own one heads the report's main table

    def pattern(self, placeholder: str | None = None) -> str:
        """`chain-B<b>`: the name with its parameter as a placeholder."""
        return f"{self.prefix}<{placeholder or self.placeholder}>"


CHAIN = Kind(
    name="chain",
    prefix="chain-B",
    placeholder="n",
    describe="chain drafting with block size n (the drafter's own B here)",
    verified=lambda block: block,
    verified_text="b tokens verified for `chain-B<b>`",
    block_size=lambda block, _drafter_block: block,
    budget=lambda _block: None,
    every_in_main_table=False,
)
TREE = Kind(
    name="ddtree",
    prefix="ddtree-",
    placeholder="N",
    describe="DDTree with N nodes besides the root",
    verified=lambda budget: budget + 1,
    verified_text="N + 1 for `ddtree-<N>`",
    block_size=lambda _budget, drafter_block: drafter_block,
    budget=lambda budget: budget,
    every_in_main_table=True,
)

# kind name -> Kind, in the report's order (chains first, then DDTree)
KINDS: dict[str, Kind] = {kind.name: kind for kind in (CHAIN, TREE)}

# Verification schemes (evaluation.verify's values; metrics.json's `scheme`, and the key of the rejection section):
# how the target accepts a step's drafts. docs/sampling.md, docs/sampling_rejection.md.
TARGET_ONLY = "target_only"  # SGLang's DFlash verify: greedy drafts, accepted with the target's probability
REJECTION = "rejection"  # dflash_generate's speculative sampling: drafts from the drafter's q, min(1, p / q)
SCHEMES = (TARGET_ONLY, REJECTION)


@dataclass(frozen=True)
class Method:
    """A parsed method name."""

    kind: Kind
    parameter: int

    @property
    def name(self) -> str:
        return f"{self.kind.prefix}{self.parameter}"

    @property
    def verified_tokens(self) -> int:
        return self.kind.verified(self.parameter)

    def block_size(self, drafter_block: int) -> int:
        return self.kind.block_size(self.parameter, drafter_block)

    @property
    def budget(self) -> int | None:
        return self.kind.budget(self.parameter)


def _choices() -> str:
    return ", ".join(f"{kind.pattern()}" for kind in KINDS.values())


def kind(name: str) -> Kind:
    """The registered kind of that name (metrics.json's `kind`)."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise DflashEvalError(f"unknown evaluation method kind {name!r}; the kinds are {', '.join(KINDS)}") from None


def name(kind_name: str, parameter: int) -> str:
    """The method's name: `name("chain", 8)` is "chain-B8"."""
    registered = kind(kind_name)
    try:
        if isinstance(parameter, bool):
            raise TypeError
        value = operator.index(parameter)
    except TypeError:
        raise DflashEvalError(
            f"evaluation method {registered.pattern()}: its parameter must be an integer, got {parameter!r}"
        ) from None
    if value < 1:
        raise DflashEvalError(f"evaluation method {registered.pattern()}: its parameter must be >= 1, got {value}")
    return f"{registered.prefix}{value}"


def chain_method(block_size: int) -> str:
    return name(CHAIN.name, block_size)


def tree_method(budget: int) -> str:
    return name(TREE.name, budget)


_NUMBER = re.compile(r"[1-9][0-9]*")  # no sign, no leading zero: a parsed name is spelled back the same


def parse(method: str) -> Method:
    """The kind and parameter of a method name; an error naming it when no kind spells it so."""
    if isinstance(method, str):
        for registered in KINDS.values():
            if method.startswith(registered.prefix):
                number = method[len(registered.prefix) :]
                if _NUMBER.fullmatch(number):
                    return Method(registered, int(number))
    raise DflashEvalError(f"evaluation method {method!r} is not one this version knows; method names are {_choices()}")


def verified_tokens(method: str) -> int:
    """Tokens the target verifies per step of the method: b for chain-B<b>, N + 1 (the root) for ddtree-<N>."""
    return parse(method).verified_tokens


def is_kind(method: str, kind_name: str) -> bool:
    return parse(method).kind is kind(kind_name)


def sort_key(method: str) -> tuple[int, int]:
    """The report's order: kinds in KINDS order, each by its parameter (ddtree-8 before ddtree-16)."""
    parsed = parse(method)
    return list(KINDS.values()).index(parsed.kind), parsed.parameter


def in_main_table(method: str, primary: bool) -> bool:
    """Whether the report's main table shows the method: the drafter's own chain and every DDTree budget."""
    return primary or parse(method).kind.every_in_main_table


def _spoken(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def legend() -> str:
    """The report's legend of the method names, one clause per kind."""
    return "; ".join(f"`{kind.pattern()}`: {kind.describe}" for kind in KINDS.values())


def verified_legend() -> str:
    """What n (the tokens a step verifies) is for each kind, for the report's speedup formula."""
    return _spoken([kind.verified_text for kind in KINDS.values()])
