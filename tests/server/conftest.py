"""The `controllers` fixture of the server tests (tests/support/server_control.py)."""

from tests.support.server_control import controllers  # noqa: F401 (a fixture)
