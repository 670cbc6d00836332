"""dflash_eval.testing.fixtures under its old name (see the package's docstring)."""

from dflash_eval.testing.fixtures import *  # noqa: F403
