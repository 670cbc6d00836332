"""dflash_eval.testing.eval_project under its old name (see the package's docstring)."""

from dflash_eval.testing.eval_project import *  # noqa: F403
