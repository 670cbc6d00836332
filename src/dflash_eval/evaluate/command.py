"""`dflash-eval evaluate`: its arguments, and the choice between one checkpoint (`stage`) and several in one process
(`several`), so that neither of those two imports the other."""

from __future__ import annotations

import argparse

from dflash_eval.config import settings_from_args
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import stage
from dflash_eval.evaluate.settings import evaluate_settings
from dflash_eval.evaluate.several import run_several


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", help="evaluate settings as JSON (what the workflow passes)")
    parser.add_argument("--config", help="config.yaml, to run by hand with --drafter and --dataset")
    parser.add_argument("--drafter")
    parser.add_argument("--dataset")
    parser.add_argument("--hidden", required=True, help="hidden-state cache directory")
    parser.add_argument("--completions", required=True, help="completions JSONL the cache was built from")
    parser.add_argument("--metrics", help="output metrics.json (one checkpoint)")
    parser.add_argument("--samples", help="output per-sample CSV (one checkpoint)")
    parser.add_argument("--placement", help="write which device (GPU) this evaluation claimed, and when, here (JSON)")
    parser.add_argument(
        "--member",
        nargs="+",
        action="extend",
        metavar="JSON",
        help='several checkpoints in this one process, each {"settings": {...}, "metrics": path, '
        '"samples": path}, all on this --hidden and --completions (instead of --settings, '
        "--metrics, --samples; what evaluation.checkpoints_per_job runs)",
    )
    parser.add_argument(
        "--store",
        help="with --member: keep each finished evaluation here, by content, and restore "
        "those whose inputs are unchanged (evaluate/result_store.py)",
    )


def run(args: argparse.Namespace) -> int:
    if args.member:
        return run_several(args)
    if not (args.metrics and args.samples):
        raise DflashEvalError(
            "evaluate: give --metrics and --samples (one checkpoint), or --member JSON ... "
            "(several checkpoints in one process)"
        )
    settings = settings_from_args(args, evaluate_settings, "drafter", "dataset")
    metrics, rows = stage.run_evaluation(settings, args.hidden, args.completions, args.placement)
    stage.write_outputs(metrics, rows, args.metrics, args.samples)
    return 0
