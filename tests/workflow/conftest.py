"""The finished tiny project and its per-test copy (tests/support/finished_project.py)."""

from tests.support.finished_project import case, finished  # noqa: F401 (fixtures)
