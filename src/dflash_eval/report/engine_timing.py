"""The engine's own step time beside our estimate: what a real SGLang measured per verify step, per dataset.

From each request's timing that fetch kept (meta_info's `e2e_latency`, with --enable-metrics
`first_token_latency`, and `spec_verify_ct`), for the served drafter at the served block size: engine ms per
verify step and tokens/s per request, beside our estimate's T_step and expected speedup for that configuration.
What the figures include (prefill, queueing, batching at concurrency > 1): docs/speedup.md ("The real engine's
own numbers"). Only JSON is read (the report imports no torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash_eval import completions
from dflash_eval.methods import chain_method
from dflash_eval.speedup import labels

INCLUDES = (
    "e2e_latency (SGLang meta_info) runs from the request's arrival to its last token: the engine step "
    "time from it includes the prefill, tokenization and any queueing; decode-only subtracts "
    "first_token_latency (given by a server started with --enable-metrics)"
)
BATCHED = (
    "fetched with {n} requests in flight: the server batched them, so a step served several requests and "
    "these per-request figures are not the batch-1 step our estimate models"
)
# what each source of a step time is called beside the estimate
ENGINE = "engine-measured (SGLang meta_info)"
ESTIMATE_SOURCES = {
    labels.USER: "user profile",
    labels.USER_SGLANG: labels.USER_SGLANG,
    labels.MEASURED: "HF profile (measured by us)",
}


def request_timing(record: dict[str, Any]) -> dict[str, Any] | None:
    """A record's engine timing when it has what the step time needs (e2e_latency and verify steps), else None."""
    engine = record.get("engine") or {}
    if engine.get("e2e_latency") is None or not engine.get("spec_verify_ct"):
        return None
    return engine


def measured(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The engine-measured step time and tokens/s over the records that carry timing (sums over requests)."""
    total, timed, concurrency, blocks = 0, [], set(), set()
    for record in records:
        total += 1
        timing = request_timing(record)
        if timing is None:
            continue
        timed.append(timing)
        if (record.get("client_timing") or {}).get("concurrency") is not None:
            concurrency.add(int(record["client_timing"]["concurrency"]))
        block = ((record.get("server") or {}).get("speculative") or {}).get("speculative_num_draft_tokens")
        if block is not None:
            blocks.add(int(block))
    if not timed:
        return {
            "recorded": False,
            "requests": total,
            "why": "no record has meta_info's e2e_latency with spec_verify_ct (fetch from a speculating "
            "SGLang over the chat endpoint: /v1/completions returns no meta_info)",
        }
    e2e = sum(t["e2e_latency"] for t in timed)
    steps = sum(int(t["spec_verify_ct"]) for t in timed)
    tokens = sum(int(t["completion_tokens"]) for t in timed)
    out: dict[str, Any] = {
        "recorded": True,
        "source": ENGINE,
        "requests": len(timed),
        "requests_without_timing": total - len(timed),
        "verify_steps": steps,
        "completion_tokens": tokens,
        "e2e_latency_s": e2e,
        "ms_per_step": 1e3 * e2e / steps,
        "tokens_per_s": tokens / e2e,
        "concurrency": sorted(concurrency),
        "block_sizes": sorted(blocks),
        "includes": INCLUDES,
    }
    if all(t.get("first_token_latency") is not None for t in timed):
        decode = sum(t["e2e_latency"] - t["first_token_latency"] for t in timed)
        if decode > 0:
            out["decode_ms_per_step"] = 1e3 * decode / steps
            out["decode_tokens_per_s"] = (tokens - len(timed)) / decode  # the tokens after each prefill's
    if max(concurrency, default=1) > 1:
        out["batched"] = BATCHED.format(n=max(concurrency))
    return out


def estimate(metrics: dict[str, Any], block: int) -> dict[str, Any]:
    """Our estimate for chain-B<block> of one evaluation: its T_step and expected speedup, and their source."""
    method = chain_method(block)
    section = metrics.get("speedup") or {}
    numbers = (metrics.get("methods") or {}).get(method) or {}
    priced = (section.get("verify") or {}).get(method)
    source = ESTIMATE_SOURCES.get(section.get("source"), section.get("source") or labels.NO_PROFILE)
    if not section.get("available") or priced is None:
        why = section.get("why") or (section.get("not_measured") or {}).get(method) or f"no estimate for {method}"
        return {"method": method, "available": False, "source": source, "why": why}
    t_step = priced["t_step_ms"] if "t_step_ms" in priced else priced["t_draft_ms"] + priced["t_verify_ms"]
    return {
        "method": method,
        "available": True,
        "source": source,
        "target_source": section.get("target_source"),
        "t_step_ms": t_step,
        "t_step_from": "t_step_ms" if "t_step_ms" in priced else "T_draft + T_verify(n)",
        "expected_speedup": numbers.get("expected_speedup"),
    }


def entry(records: list[dict[str, Any]], metrics: dict[str, Any] | None, drafter: str | None) -> dict[str, Any]:
    """One dataset's engine timing beside the served drafter's estimate at the served block (trust.json)."""
    engine = measured(records)
    out = {"drafter": drafter, "engine": engine}
    if not engine["recorded"] or metrics is None:
        return out
    blocks = engine["block_sizes"]
    if len(blocks) != 1:
        return {**out, "estimate": {"available": False, "why": f"served block sizes {blocks}: not one"}}
    out["estimate"] = guess = estimate(metrics, blocks[0])
    if guess["available"]:
        out["engine_over_estimate"] = engine["ms_per_step"] / guess["t_step_ms"]
        if "decode_ms_per_step" in engine:
            out["engine_decode_over_estimate"] = engine["decode_ms_per_step"] / guess["t_step_ms"]
    return out


def panel(
    metrics_by_key: dict[tuple[str, str], dict], settings: dict[str, Any], completion_files: Iterable[str | Path]
) -> dict[str, dict[str, Any]]:
    """Per dataset with a completions file: entry() for report.served_drafter (None: engine numbers alone)."""
    served = settings.get("served_drafter")
    out = {}
    for path in map(Path, completion_files):
        dataset = path.name.removesuffix(".jsonl")
        if dataset not in settings["datasets"] or not path.is_file():
            continue
        records = [record for _, record in completions.iter_records(path)]
        out[dataset] = entry(records, metrics_by_key.get((served, dataset)) if served else None, served)
    return out


def _ms(value: Any) -> str:
    return "–" if value is None else f"{value:.3g} ms"


def lines(entries: dict[str, dict[str, Any]]) -> list[str]:
    """summary.md's table: the engine's measured step time beside our estimate (nothing when no dataset has one)."""
    if not any(e["engine"]["recorded"] for e in entries.values()):
        return []
    out = [
        "### The engine's own step time beside the estimate",
        "",
        f"Per dataset, the served drafter at the served block: engine ms per verify step = sum(e2e_latency) / "
        f"sum(spec_verify_ct), and tokens/s = completion tokens / e2e_latency, over the requests fetch timed "
        f"({ENGINE}), beside our estimate's T_step for that method and its expected speedup, with the estimate's "
        f"source. {INCLUDES}.",
        "",
        "| dataset | served drafter | method | requests | concurrency | engine ms / step | decode-only ms / step "
        "| tokens/s per request | estimate T_step | engine / estimate | expected speedup (estimate) | estimate source |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    notes = []
    for dataset, e in entries.items():
        engine = e["engine"]
        if not engine["recorded"]:
            continue
        guess = e.get("estimate") or {"available": False, "why": "report.served_drafter not set"}
        speedup = guess.get("expected_speedup")
        cells = [
            dataset,
            e["drafter"] or "–",
            guess.get("method", "–"),
            engine["requests"],
            ", ".join(map(str, engine["concurrency"])) or "–",
            _ms(engine["ms_per_step"]),
            _ms(engine.get("decode_ms_per_step")),
            f"{engine['tokens_per_s']:.4g}",
            _ms(guess.get("t_step_ms")) if guess["available"] else f"none: {guess['why']}",
            f"{e['engine_over_estimate']:.3g}×" if "engine_over_estimate" in e else "–",
            "–" if speedup is None else f"{speedup:.2f}×",
            guess.get("source", "–"),
        ]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
        if engine.get("batched"):
            notes.append(f"- {dataset}: {engine['batched']}.")
        if engine["requests_without_timing"]:
            notes.append(f"- {dataset}: {engine['requests_without_timing']} request(s) without timing left out.")
    return out + [""] + notes + ([""] if notes else [])
