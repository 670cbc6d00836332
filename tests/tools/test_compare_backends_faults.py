"""compare-backends' options all say what they do."""

from __future__ import annotations

import argparse

from dflash_eval.tools.compare_backends import add_arguments


def test_every_option_has_help_and_dtype_names_its_choices():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in options), [a.dest for a in options if not a.help]
    dtype = next(a for a in options if a.dest == "dtype")
    assert "bfloat16" in dtype.choices and "default bfloat16" in dtype.help
