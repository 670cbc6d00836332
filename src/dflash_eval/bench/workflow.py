"""dflash_eval.testing.workflow under its old name, its copies taken from the checkout this file lies in (see the
package's docstring; tests/support/checkout.py is the new home of that)."""

from pathlib import Path

from dflash_eval.testing import workflow
from dflash_eval.testing.workflow import *  # noqa: F403

REPO = Path(__file__).resolve().parents[3]


def copy_workflow(dest: Path) -> Path:
    return workflow.copy_workflow(dest, REPO)
