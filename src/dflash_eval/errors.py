"""One exception type for every user-facing problem, so the CLI can print it without a traceback."""


class DflashEvalError(Exception):
    """A problem with the user's input (file, key or value) whose message names the fix."""


class Terminated(BaseException):
    """Raised by our SIGTERM handler so that ``finally`` blocks run (Snakemake cancels with SIGTERM).

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it.
    """
