"""`dflash-eval`: one subcommand per stage, so every Snakemake rule is also a command you can run."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import signal
import sys

from dflash_eval.commands import COMMANDS
from dflash_eval.errors import DflashEvalError, Terminated


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-eval", description=__doc__)
    parser.add_argument("--log", help="also write the log to this file (Snakemake's log:)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add, _, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            getattr(importlib.import_module(module), add)(command)
    return parser


def _setup_logging(path: str | None, verbose: bool) -> None:
    # With --log the rules also send stderr (progress bars, tracebacks) to the same file: log once.
    handlers: list[logging.Handler] = [
        logging.FileHandler(path, mode="a", encoding="utf-8") if path else logging.StreamHandler(sys.stderr)
    ]
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        handlers=handlers,
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _parser_without_collections(command: str | None) -> argparse.ArgumentParser:
    """The parser, importing the command's stage (torch, transformers, dflash) with the cyclic collector off.

    Those imports create millions of long-lived objects, and the collector's full passes over them
    find nothing to free, yet take a noticeable share of the import (benchmarks/results/startup.md).
    Freezing what the imports made keeps later collections from walking it again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return build_parser(only=command)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def main(argv: list[str] | None = None, frozen_imports: bool = False) -> int:
    """Run one command; `frozen_imports` (the console script) imports its stage as `_parser_without_collections`
    does, which a long-lived caller (a test session) should not: what is frozen is never collected."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    parser = _parser_without_collections(command) if frozen_imports else build_parser(only=command)
    args = parser.parse_args(argv)
    _setup_logging(args.log, args.verbose)
    module, _, run_name, _ = COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(module), run_name)(args) or 0)
    except DflashEvalError as error:
        logging.getLogger("dflash-eval").error("%s", error)
        return 2
    except Terminated:  # the stage's finally blocks already ran (records flushed, server restored)
        logging.getLogger("dflash-eval").error(
            "%s stopped by SIGTERM; what it finished is kept, and a rerun continues from there", args.command
        )
        return 128 + signal.SIGTERM


def entry() -> None:
    """The console script: `main`, then an exit that skips the collector's last pass over every object.

    Python's shutdown collects all objects still alive; with torch and transformers loaded that pass
    is slow (benchmarks/results/startup.md) and frees nothing the process' exit would not. Freezing them
    first skips it; exit handlers (log files, progress bars) still run.
    """
    code = main(frozen_imports=True)
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
