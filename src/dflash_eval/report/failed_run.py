"""A failed report job leaves a marker, so the next run rebuilds the report it kept.

The report's outputs are update(): when the job fails, Snakemake copies the last report back (a new mtime) and
records the failed job's params and code as theirs (snakemake/snakemake#3808). Without more, the next run finds
the old report up to date and says "Nothing to be done" after any params or code change that made the job fail.
The rule's shell writes the marker when the command fails; at the next workflow load the kept report is dated
before its oldest input and the marker is removed, so Snakemake rebuilds the report ("updated input files").
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def date_kept_report_before_inputs(
    marker: str | Path, outputs: Iterable[str | Path], inputs: Iterable[str | Path]
) -> list[str]:
    """After a failed report job: date each kept output a second before the oldest input, drop the marker.

    Returns the outputs dated (none when no job failed). Dating, not deleting, keeps the last report readable
    until the rebuild replaces it; the dates alone make Snakemake rebuild it, so the marker can go at once.
    """
    marker = Path(marker)
    if not marker.exists():
        return []
    times = [path.stat().st_mtime for path in map(Path, inputs) if path.exists()]
    before = min(times) - 1 if times else 0.0
    dated = []
    for output in map(Path, outputs):
        if output.exists():
            os.utime(output, (before, before))
            dated.append(str(output))
    marker.unlink()
    return dated
