"""One exception type for every user-facing problem, so the CLI can print it without a traceback."""


class DflashEvalError(Exception):
    """A problem with the user's input (file, key or value) whose message names the fix."""
