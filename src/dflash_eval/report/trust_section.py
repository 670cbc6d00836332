"""summary.md's trust panel, rendered from report/trust.py's data: its warnings, the hidden-state caches, online
against offline, and the server's outages (docs/trust.md)."""

from __future__ import annotations

from typing import Any

from dflash_eval.report import online as online_check
from dflash_eval.report.md_table import table_row
from dflash_eval.report.trust import NOT_RECORDED


def trust_warnings(trust: dict) -> list[str]:
    """The trust findings that make a number suspect, one markdown line each."""
    found = []
    for dataset, fetch in trust["fetch"].items():
        bad = sorted(set(fetch.get("prompt_token_mismatches", [])) | set(fetch.get("completion_token_mismatches", [])))
        if bad:
            found.append(
                f"**Token mismatch at fetch**: {dataset}: {len(bad)} of {fetch['records']} records' token "
                f"ids disagree with the server's own counts (e.g. {', '.join(bad[:3])}); their tau "
                "is measured on tokens the server may not have produced."
            )
    for dataset, fetch in trust["fetch"].items():
        for warning in fetch.get("sampling_warnings", []):
            found.append(f"**Sampling not lossless**: {dataset}: {warning}.")
    for cache in trust["caches"]:
        if cache.get("completions_match") is False:
            found.append(
                f"**Stale cache**: {cache['dir']} was extracted from another completions file "
                f"(sha256 {str(cache['completions_sha256'])[:12]}) than the one fetched now; re-run extraction."
            )
        past = (cache.get("positions") or {}).get("past")
        if past:
            found.append(
                f"**Past the target's positions**: {cache['dir']}: {len(past)} of {cache['samples']} samples "
                f"are longer than its max_position_embeddings {cache['positions']['max_position_embeddings']} "
                f"(e.g. {', '.join(past[:3])}); the target's states there are extrapolated."
            )
    for dataset, online in trust["online"].items():
        check = online.get("served_drafter_check") or {}
        if check.get("status") == "mismatch":
            what = (
                "paired anyway (report.allow_served_drafter_mismatch)"
                if check["allowed"]
                else "not paired (report.allow_served_drafter_mismatch: true pairs them anyway)"
            )
            found.append(
                f"**Served drafter ≠ report.served_drafter**: {dataset}: {'; '.join(check['problems'])}; {what}."
            )
        if online.get("beyond_tolerance"):
            found.append(
                f"**Online ≠ offline**: {dataset}: the server measured tau "
                f"{online['online_tau_compared']:.2f}, offline gives {online['offline_tau_compared']:.2f} for "
                f"{online['drafter']} on the same {online['samples_compared']} samples "
                f"({online['relative_difference']:.1%} apart, tolerance {online['tolerance']:.1%})."
            )
    server = trust["server"]
    if server.get("recorded") and server["unrestored"]:
        found.append(
            f"**Server not restored**: {server['unrestored']} pause(s) in {server['path']} have no "
            "successful resume; check that the server is up."
        )
    return found


def _short(digest: Any, digits: int = 12) -> str:
    return str(digest)[:digits] if digest else NOT_RECORDED


def _versions(versions: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) if versions else NOT_RECORDED


def cache_table(caches: list[dict]) -> list[str]:
    """One row per cache: what produced the hidden states the drafters were scored on."""
    header = [
        "cache",
        "target",
        "layers",
        "kernel backend",
        "versions",
        "dtype",
        "device",
        "shards (sha256)",
        "built from completions",
    ]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for cache in caches:
        if not cache["recorded"]:
            lines.append(table_row([f"`{cache['dir']}`"] + [NOT_RECORDED] * (len(header) - 1)))
            continue
        target = (
            f"{cache['target']} ({cache['model_type']}, {cache['num_hidden_layers']} layers, config "
            f"{_short(cache['target_config_hash'])})"
        )
        device = cache["device"] or NOT_RECORDED
        if cache.get("device_name") and cache["device_name"] != device:
            device += f" ({cache['device_name']})"
        shards = "<br>".join(f"{s['file']} {_short(s['sha256'])}" for s in cache["shards"]) or NOT_RECORDED
        built = {
            None: f"{_short(cache['completions_sha256'])} (current file {NOT_RECORDED})",
            True: f"{_short(cache['completions_sha256'])} (= current file)",
            False: f"**{_short(cache['completions_sha256'])} ⚠️ NOT the current file**",
        }[cache["completions_match"]]
        lines.append(
            table_row(
                [
                    f"`{cache['dir']}`",
                    target,
                    ", ".join(map(str, cache["layer_ids"] or [])) or NOT_RECORDED,
                    f"{cache['backend'] or NOT_RECORDED}",
                    _versions(cache["versions"]),
                    cache["dtype"] or NOT_RECORDED,
                    device,
                    shards,
                    built,
                ]
            )
        )
    return lines


ONLINE_DEFINITIONS = (
    f"tau: {online_check.TAU_OURS}, mean over requests (z-lab). SGLang's accept length: {online_check.TAU_SGLANG}; "
    "it exceeds tau by 1/steps per request. Equal per request: the server's verification steps and completion "
    "tokens equal ours, and its accepted drafts (spec_num_correct_drafts, histogram) equal ours except for what a "
    "last step accepted past the stop token or max_tokens, which SGLang counts and the output does not hold "
    "(exactly: no such difference)."
)


def online_table(online: dict[str, dict]) -> list[str]:
    """Per dataset: the server's tau beside ours on the same requests, both conventions (report/online.py)."""
    lines = [
        table_row(
            [
                "dataset",
                "served drafter",
                "method",
                "requests",
                "online tau",
                "offline tau",
                "online − offline (95% CI)",
                "SGLang accept length online / offline",
                "equal per request",
                "flag",
            ]
        ),
        table_row(["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"]),
    ]
    for dataset, e in online.items():
        drafter = e.get("drafter") or "not set (report.served_drafter)"
        if not e.get("recorded"):
            why = e.get("why") or "no speculative counters in the completions"
            lines.append(table_row([dataset, drafter, "–", "–", f"{NOT_RECORDED} ({why})", "–", "–", "–", "–", "–"]))
        elif not e.get("compared"):
            lines.append(
                table_row(
                    [
                        dataset,
                        drafter,
                        e.get("method") or "–",
                        e["samples_with_stats"],
                        f"{e['online_tau_mean_of_samples']:.3f}",
                        "–",
                        "–",
                        f"{e['online_tau_sglang_mean_of_samples']:.3f} / –",
                        "–",
                        f"not compared: {e.get('why', '')}",
                    ]
                )
            )
        else:
            diff = e["paired_difference"]
            flag = f"**⚠️ beyond {e['tolerance']:.1%}**" if e["beyond_tolerance"] else f"within {e['tolerance']:.1%}"
            if (e.get("served_drafter_check") or {}).get("status") == "mismatch":
                flag += "; **⚠️ served drafter mismatch**"
            equal = f"{e['equal_requests']} of {e['samples_compared']} ({e['exact_requests']} exactly)"
            if e["unequal_ids"]:
                equal += f"; differ: {', '.join(e['unequal_ids'][:3])}"
            lines.append(
                table_row(
                    [
                        dataset,
                        drafter,
                        e["method"],
                        e["samples_compared"],
                        f"{e['online_tau_compared']:.3f}",
                        f"{e['offline_tau_compared']:.3f}",
                        f"{diff['difference']:+.4f} ({diff['ci95'][0]:+.4f}, {diff['ci95'][1]:+.4f})",
                        f"{e['online_tau_sglang_compared']:.3f} / {e['offline_tau_sglang_compared']:.3f}",
                        equal,
                        flag,
                    ]
                )
            )
    return lines


def outage_lines(server: dict) -> list[str]:
    """Each pause of the server around extraction and how long it lasted."""
    if not server.get("recorded"):
        where = f" ({server['path']} absent)" if server.get("path") else ""
        return [f"Server transitions: {NOT_RECORDED}{where}."]
    if not server["outages"]:
        return [f"No server outage in `{server['path']}` (the server was never paused while up)."]
    longest = "n/a" if server["longest_s"] is None else f"{server['longest_s']:.1f} s"
    profiled = any(outage.get("profiles") for outage in server["outages"])  # profile-server's pauses, apart
    lines = [
        f"{server['count']} outage(s) in `{server['path']}`, {server['total_s']:.1f} s in all, longest {longest}.",
        "",
        table_row(
            ["paused at", "back at", "outage", "restored", "extractions"]
            + (["profile-server runs"] if profiled else [])
        ),
        table_row(["---", "---", "---:", "---", "---:"] + (["---:"] if profiled else [])),
    ]
    for outage in server["outages"]:
        seconds = "**never ended ⚠️**" if outage["seconds"] is None else f"{outage['seconds']:.1f} s"
        lines.append(
            table_row(
                [
                    outage["start"],
                    outage["end"] or "–",
                    seconds,
                    "yes" if outage["restored"] else "**no ⚠️**",
                    outage.get("extractions", 0),
                ]
                + ([outage.get("profiles", 0)] if profiled else [])
            )
        )
    return lines
