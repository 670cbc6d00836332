"""The report stage: every drafter x dataset metrics.json into summary.csv, summary.md, trust.json and plots.

metrics_files.py reads and checks the metrics.json files, summary.py makes the rows, trust.py the trust panel's
data, markdown.py the page (from its *_section.py parts), plots.py (a registry) the PNGs. Every file is rendered
before the first is written, so a failure leaves the last report as it was (workflow/rules/report.smk). It reads
only JSON and imports neither torch nor transformers, so the report reruns in a second even on a loaded machine.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dflash_eval.config import settings_from_args
from dflash_eval.io_utils import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)
from dflash_eval.methods import TARGET_ONLY
from dflash_eval.provenance.stamps import STAMP, stage_stamp
from dflash_eval.report import (
    backends,
    best_checkpoint,
    diagnostics_section,
    engine_timing,
    export,
    markdown,
    metrics_files,
    plots,
    server_profile,
    speedup,
    speedup_section,
    summary,
    tau_section,
    trust,
    trust_section,
)
from dflash_eval.report.settings import report_settings
from dflash_eval.report.stamps import lines as stamp_lines
from dflash_eval.report.stamps import stamps_panel
from dflash_eval.speedup import validation

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--settings", help="report settings as JSON (what the workflow passes)")
    parser.add_argument("--config", help="config.yaml, to run by hand")
    parser.add_argument("--metrics", nargs="+", required=True, help="metrics.json of every drafter x dataset")
    parser.add_argument(
        "--hidden",
        nargs="*",
        default=[],
        help="hidden-state cache directories, for the trust panel (default: each metrics' cache dir)",
    )
    parser.add_argument(
        "--completions",
        nargs="*",
        default=[],
        help="completions JSONL per dataset (results/completions/{dataset}.jsonl), for the trust panel",
    )
    parser.add_argument("--transitions", help="the server hook's transitions.jsonl (default: from the settings)")
    parser.add_argument("--csv", required=True, help="output tidy summary CSV")
    parser.add_argument("--md", required=True, help="output markdown summary")
    parser.add_argument("--trust", help="output JSON: the trust panel, machine-readable")
    parser.add_argument(
        "--backend-comparisons",
        nargs="*",
        default=[],
        help="compare-backends results (results/backends/{drafter}/{dataset}/{dtype}.json)",
    )
    parser.add_argument(
        "--server-profile",
        help="dflash-eval profile-server's JSON (results/server_profile.json), "
        "set beside the estimate (profile_server.enabled)",
    )
    add_profile_arguments(parser)
    parser.add_argument(
        "--plot-dir",
        required=True,
        help="output folder of the plots: " + ", ".join(plot.file for plot in plots.PLOTS.values()),
    )


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The target profile the expected speedup is made from (report/speedup.py): one of the two, or neither."""
    parser.add_argument(
        "--target-profile",
        help="the profile the profile_target rule timed (results/profile/<target>/<device>-<dtype>-<backend>.json)",
    )
    parser.add_argument("--user-profile", help="the user's speedup.profile (then the target was not timed)")


def target_profile(args: argparse.Namespace) -> tuple[dict | None, str, bool, str | None]:
    """(profile, its source, named by the user, its estimate-code stamp) from --target-profile / --user-profile."""
    named_by_user = bool(getattr(args, "user_profile", None))
    path = args.user_profile if named_by_user else getattr(args, "target_profile", None)
    profile, source, stamp = speedup.load_target_profile(path, named_by_user)
    return profile, source, named_by_user, stamp


def run(args: argparse.Namespace) -> int:
    settings = metrics_files.ordered_settings(settings_from_args(args, report_settings))
    metrics_files.check_settings(settings)
    evaluations = metrics_files.collect(settings, args.metrics)
    profile, source, named_by_user, stamp = target_profile(args)
    for evaluation in evaluations:  # the expected speedup, made here from each metrics.json and the profile
        speedup.apply(evaluation.metrics, profile, source, named_by_user, stamp)
    rows = summary.summary_rows(evaluations, settings)
    best = best_checkpoint.mark(rows, evaluations, settings)
    panel = trust.panel(
        evaluations, settings, args.hidden, args.completions, args.transitions or settings.get("transitions")
    )
    panel["engine_timing"] = engine_timing.panel({e.key: e.metrics for e in evaluations}, settings, args.completions)
    if args.server_profile:
        panel["server_profile"] = server_profile.profile_panel(
            server_profile.load_profile(args.server_profile), {e.key: e.metrics for e in evaluations}, settings
        )
    panel["speedup_validation"] = validation.panel(speedup_section.estimate_stamps(evaluations))
    panel[STAMP], panel["inputs_code_identity"] = stage_stamp("report"), stamps_panel(evaluations, args.hidden)
    panel["best_checkpoints"] = [b.as_dict() for b in best]
    panel["warnings"] = trust_section.trust_warnings(panel)
    comparisons = backends.load(args.backend_comparisons)
    if comparisons:
        panel["backend_comparisons"] = comparisons
    served = [row for row in rows if row["scheme"] == TARGET_ONLY]  # the tables and plots; the CSV has all
    data = plots.PlotData(rows=served, metrics={e.key: e.metrics for e in evaluations}, settings=settings, trust=panel)
    csv = summary.summary_frame(rows).to_csv(index=False)
    page = markdown.render(served, evaluations, settings, panel)
    if len(served) < len(rows):
        page = page.rstrip("\n") + "\n\n" + "\n".join(tau_section.rejection_table(rows, settings))
    page = page.rstrip("\n") + "\n\n" + "\n".join(best_checkpoint.lines(best) + export.lines())
    if comparisons:  # after the diagnostics: what the other kernel backend would have done to tau
        page = page.rstrip("\n") + "\n\n" + "\n".join(backends.lines(comparisons))
    page = page.rstrip("\n") + "\n\n" + "\n".join(stamp_lines(panel[STAMP], panel["inputs_code_identity"]))
    pngs = {Path(args.plot_dir) / plot.file: plots.png(plot, data) for plot in plots.PLOTS.values()}
    # Only now, with everything rendered, is anything written.
    atomic_write_text(args.csv, csv)
    atomic_write_text(args.md, page)
    written = [args.csv, args.md]
    if args.trust:
        atomic_write_json(args.trust, panel)
        written.append(args.trust)
    for path, content in pngs.items():
        atomic_write_bytes(path, content)
        written.append(path)
    for warning in diagnostics_section.evaluation_warnings(evaluations) + panel["warnings"]:
        log.warning("%s", diagnostics_section.plain(warning))
    log.info("report of %d evaluations written: %s", len(evaluations), ", ".join(map(str, written)))
    return 0
