"""Which GPU each job took, read back from the claims `evaluate.gpu` recorded: no two at once on one GPU.

Snakemake's `--resources gpu=K` only counts jobs; the per-GPU locks choose the GPU. This module is the
check that both held on a real run: every record's interval [start, end] on its (host, GPU), sorted, must
not overlap the next one's, and the peak of jobs running at once says whether K really ran side by side.
`dflash-eval gpu-placements results/benchmarks/evaluate` runs it on a finished workflow. `UtilisationSampler`
reads `nvidia-smi` (utilisation and memory per GPU) during a run, where the driver is present.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_eval.errors import DflashEvalError

SUFFIX = ".gpu.json"
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,uuid,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


def read_records(paths: list[Path]) -> list[dict]:
    """Every claim record under `paths` (files, or folders searched for *.gpu.json), each with its `file`."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(path.rglob(f"*{SUFFIX}")))
        elif path.is_file():
            files.append(path)
        else:
            raise DflashEvalError(f"{path}: no such file or folder of GPU claim records (*{SUFFIX})")
    records = []
    for file in files:
        try:
            record = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise DflashEvalError(f"{file}: not a GPU claim record ({error}); delete it and rerun its job") from error
        problem = record_problem(record)
        if problem:
            raise DflashEvalError(f"{file}: not a GPU claim record ({problem}); delete it and rerun its job")
        records.append({**record, "file": str(file)})
    if not records:
        raise DflashEvalError(
            f"no GPU claim records (*{SUFFIX}) in {', '.join(map(str, paths))}: nothing to check "
            "(an evaluation writes one per job next to its benchmark, results/benchmarks/evaluate/)"
        )
    return records


def record_problem(record: object) -> str | None:
    """What makes `record` unusable (a missing key, a time that is not a number), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for key in ("device", "start"):
        if key not in record:
            return f"no {key!r}"
    if not isinstance(record["device"], str):
        return f"'device' is {record['device']!r}, not a device name"
    for key in ("start", "end"):
        value = record.get(key)
        if (value is not None or key == "start") and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"{key!r} is {value!r}, not seconds since the epoch"
    if record["device"].startswith("cuda") and "gpu" not in record:
        return f"a {record['device']} claim without 'gpu', the GPU it held"
    return None


@dataclass
class PlacementCheck:
    """What the records say: jobs per GPU, the overlaps (must be none), the unfinished, the peak at once."""

    jobs_per_gpu: dict[str, int] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    peak: int = 0  # the most GPU jobs running at one moment
    cpu_jobs: int = 0
    span_s: float = 0.0  # first start to last end of the GPU jobs

    @property
    def ok(self) -> bool:
        return not self.overlaps and not self.unfinished


def check_placements(records: list[dict]) -> PlacementCheck:
    result = PlacementCheck()
    gpu_jobs = []
    for record in records:
        if not str(record["device"]).startswith("cuda"):
            result.cpu_jobs += 1
        elif record.get("end") is None:
            result.unfinished.append(
                f"{record['file']}: {record['device']} claimed at {record['start']:.3f} has no "
                "end (the job was killed, or is still running)"
            )
        else:
            gpu_jobs.append(record)
    by_gpu: dict[str, list[dict]] = {}
    for record in gpu_jobs:
        by_gpu.setdefault(f"{record.get('host', '?')}/{record['gpu']}", []).append(record)
    for name, claims in sorted(by_gpu.items()):
        result.jobs_per_gpu[name] = len(claims)
        claims.sort(key=lambda r: r["start"])
        for first, second in zip(claims, claims[1:], strict=False):
            if second["start"] < first["end"]:
                result.overlaps.append(
                    f"{name}: {second['file']} started at {second['start']:.3f}, before "
                    f"{first['file']} ended at {first['end']:.3f}"
                )
    # the peak: ends sort before starts at the same instant (a GPU handed over is not two at once)
    events = sorted([(r["start"], 1) for r in gpu_jobs] + [(r["end"], -1) for r in gpu_jobs])
    running = 0
    for _, step in events:
        running += step
        result.peak = max(result.peak, running)
    if gpu_jobs:
        result.span_s = max(r["end"] for r in gpu_jobs) - min(r["start"] for r in gpu_jobs)
    return result


def report_lines(check: PlacementCheck) -> list[str]:
    lines = ["| GPU (host/identity) | jobs |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in check.jobs_per_gpu.items()]
    lines.append(
        f"\nGPU jobs at once, at most: {check.peak}; span {check.span_s:.1f} s; CPU jobs: {check.cpu_jobs}; "
        f"overlaps on one GPU: {len(check.overlaps)}; unfinished: {len(check.unfinished)}"
    )
    return lines + [f"OVERLAP {line}" for line in check.overlaps] + [f"UNFINISHED {line}" for line in check.unfinished]


def parse_nvidia_smi(text: str) -> list[dict]:
    """`index, uuid, utilization.gpu, memory.used` lines -> one dict per GPU ("[N/A]" fields -> None)."""
    rows = []
    for line in text.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 4:
            raise DflashEvalError(f"unexpected nvidia-smi line {line!r} (wanted index, uuid, utilization, memory)")

        def number(value: str) -> float | None:
            try:
                return float(value)
            except ValueError:  # "[N/A]", "[Not Supported]"
                return None

        rows.append({"index": int(parts[0]), "uuid": parts[1], "util": number(parts[2]), "mem_mib": number(parts[3])})
    return rows


class UtilisationSampler:
    """`nvidia-smi` every `interval_s` in a thread, while in a `with` block; empty where nvidia-smi is absent."""

    def __init__(self, interval_s: float = 0.5, command: list[str] | None = None):
        self.interval_s = interval_s
        self.command = command or NVIDIA_SMI
        self.samples: list[tuple[float, list[dict]]] = []
        self.available = shutil.which(self.command[0]) is not None
        self.error: str | None = None if self.available else f"{self.command[0]} is not on PATH"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(self.command, capture_output=True, text=True, timeout=10, check=True).stdout
                self.samples.append((time.time(), parse_nvidia_smi(out)))
            except (subprocess.SubprocessError, OSError, DflashEvalError) as error:
                self.error = str(error)
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> UtilisationSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean_utilisation(self) -> dict[int, float]:
        """Mean utilisation (%) per GPU index over the samples that report one."""
        values: dict[int, list[float]] = {}
        for _, rows in self.samples:
            for row in rows:
                if row["util"] is not None:
                    values.setdefault(row["index"], []).append(row["util"])
        return {index: sum(v) / len(v) for index, v in sorted(values.items())}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        help=f"claim records (*{SUFFIX}) or folders of them, e.g. results/benchmarks/evaluate",
    )
    parser.add_argument("--expect-peak", type=int, help="fail unless exactly this many GPU jobs ran at once at most")
    parser.add_argument("--json", type=Path, help="also write the check as JSON here")


def run(args: argparse.Namespace) -> int:
    check = check_placements(read_records(args.paths))
    print("\n".join(report_lines(check)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(check.__dict__, indent=1) + "\n")
    if not check.ok:
        raise DflashEvalError(
            f"{len(check.overlaps)} overlap(s) and {len(check.unfinished)} unfinished claim(s) "
            "in the GPU records (listed above)"
        )
    if args.expect_peak is not None and check.peak != args.expect_peak:
        raise DflashEvalError(f"at most {check.peak} GPU job(s) ran at once, not the {args.expect_peak} expected")
    return 0
