"""Several checkpoints in one evaluate process: start-up (Python, torch, CUDA, the imports, the GPU claim) paid once.

`dflash-eval evaluate --member JSON ... --hidden DIR --completions FILE [--store DIR]`, what the workflow runs for
`evaluation.checkpoints_per_job` > 1. Each member is one checkpoint's evaluation exactly as `--settings` would run
it (`stage.run_evaluation`, the same outputs byte for byte); they share one cache and one claimed device. With
`--store` each finished member is kept there by content (`result_store`) before the next one starts, and a member
whose inputs are unchanged is restored from it instead of evaluated: so a rerun of the job (Snakemake removed all
its outputs) evaluates only the checkpoints that changed, and an interrupted one loses none that finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass

from dflash_eval.config import settings_from_args
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import stage
from dflash_eval.evaluate.result_store import ResultStore, key_of, key_parts
from dflash_eval.evaluate.settings import evaluate_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    settings: dict
    metrics: str
    samples: str


def parse_members(texts: list[str], runtime: str | None = None) -> list[Member]:
    """`--member` values -> checked members: each a JSON object with settings, metrics and samples; one device."""
    members = []
    for i, text in enumerate(texts):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DflashEvalError(f"--member {i + 1}: not valid JSON ({error})") from error
        missing = [key for key in ("settings", "metrics", "samples") if not isinstance(data, dict) or key not in data]
        if missing:
            raise DflashEvalError(
                f"--member {i + 1}: needs the keys settings, metrics and samples (missing {', '.join(missing)})"
            )
        raw = data["settings"] if isinstance(data["settings"], str) else json.dumps(data["settings"])
        settings = settings_from_args(argparse.Namespace(settings=raw, runtime=runtime), evaluate_settings)
        members.append(Member(settings, str(data["metrics"]), str(data["samples"])))
    devices = sorted({m.settings["device"] for m in members})
    if len(devices) > 1:
        raise DflashEvalError(
            f"--member: the checkpoints of one process share its device, but they ask for "
            f"{', '.join(devices)}; run one process per device"
        )
    outputs = [path for m in members for path in (m.metrics, m.samples)]
    repeated = sorted({p for p in outputs if outputs.count(p) > 1})
    if repeated:
        raise DflashEvalError(f"--member: two checkpoints would write {', '.join(repeated)}; give each its own outputs")
    return members


def run_several(args: argparse.Namespace) -> int:
    if args.settings or args.metrics or args.samples:
        raise DflashEvalError("evaluate: --member replaces --settings, --metrics and --samples; give one or the other")
    members = parse_members(args.member, getattr(args, "runtime", None))
    store = ResultStore(args.store) if args.store else None
    names = ", ".join(m.settings["drafter"] for m in members)
    device = stage.claim_settings_device(
        members[0].settings, args.placement, f"evaluate {names} {members[0].settings['dataset']}"
    )
    done = {"evaluated": 0, "restored": 0}
    for i, member in enumerate(members):
        settings, started = member.settings, time.perf_counter()
        outputs = {"metrics.json": member.metrics, "samples.csv": member.samples}
        what = f"{settings['drafter']} on {settings['dataset']} ({i + 1} of {len(members)})"
        parts = key = None
        if store is not None:
            parts = key_parts(settings, args.hidden, args.completions)
            key = key_of(parts)
            if store.restore(settings["drafter"], settings["dataset"], key, outputs):
                done["restored"] += 1
                log.info(
                    "%s: restored from %s (its inputs are unchanged)",
                    what,
                    store.entry(settings["drafter"], settings["dataset"]),
                )
                continue
        metrics, rows = stage.run_evaluation(settings, args.hidden, args.completions, device=device)
        stage.write_outputs(metrics, rows, member.metrics, member.samples)
        if store is not None:
            if metrics["checkpoint"]["sha256"] != parts["checkpoint"]:  # rewritten between the key and the load
                raise DflashEvalError(
                    f"{settings['checkpoint']['path']}: the checkpoint changed while this job ran; "
                    "its outputs are written but not kept in the store: rerun"
                )
            store.save(settings["drafter"], settings["dataset"], key, parts, outputs)
        done["evaluated"] += 1
        log.info("%s: evaluated in %.2f s", what, time.perf_counter() - started)
    log.info(
        "%d checkpoint(s) evaluated, %d restored, in one process on %s", done["evaluated"], done["restored"], device
    )
    return 0
