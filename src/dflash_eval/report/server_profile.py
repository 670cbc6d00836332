"""trust.json's `server_profile` and its summary.md lines: what dflash-eval profile-server measured on the managed
server, per setting, and the served drafter's chain priced from that profile beside the engine's own tokens/s and
our estimate (docs/speedup.md). Only JSON is read (the report imports no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_eval.cache.serving_profile import check_profile
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import read_json_object
from dflash_eval.methods import chain_method
from dflash_eval.report.engine_timing import ENGINE, estimate
from dflash_eval.report.summary import dataset_sampling
from dflash_eval.speedup import labels

PROFILED = (
    "measured by dflash-eval profile-server on the managed server (profile_server.enabled): batch 1, native "
    "/generate, decode = e2e_latency - first_token_latency, one restart per setting"
)


def load_profile(path: str | Path) -> dict[str, Any]:
    """A profile-server file, checked as a serving profile (errors name the file and field) and by its format."""
    data = read_json_object(Path(path))
    if data.get("format") != labels.SERVER_PROFILE_FORMAT:
        raise DflashEvalError(
            f"{path}: not a dflash-eval profile-server file (format {data.get('format')!r}, want "
            f"{labels.SERVER_PROFILE_FORMAT!r})"
        )
    return check_profile(data, path)


def _tau(metrics: dict[str, Any] | None, method: str) -> float | None:
    tau = (((metrics or {}).get("methods") or {}).get(method) or {}).get("tau_token_weighted")
    return None if tau is None or tau != tau else float(tau)


def profile_panel(
    profile: dict[str, Any], metrics_by_key: dict[tuple[str, str], dict], settings: dict[str, Any]
) -> dict[str, Any]:
    """trust.json's `server_profile`: what profile-server measured per setting, and per dataset the served drafter's
    chain at the served block priced from that profile (user profile (SGLang)): predicted speedup = offline tau x
    T_AR / T_step(b) and the tokens/s it implies (x 1000 / T_AR), beside the engine's own measured tokens/s and
    speedup for the served configuration (its `served` setting, no forced acceptance), and our estimate (estimate())."""
    block = int(profile["block_size"])
    method, served = chain_method(block), settings.get("served_drafter")
    t_ar, t_step = float(profile["t_ar_ms"]), float(profile["t_step_ms"][block])
    by_name = {s["name"]: s for s in profile["settings"]}
    run = by_name.get("served") or {}
    engine_ms_per_token = (run.get("decode_ms_per_token") or {}).get("median")
    engine = {
        "source": ENGINE,
        "setting": "served",
        "requests": run.get("requests"),
        "ms_per_step": (run.get("ms_per_step") or {}).get("median"),
        "tokens_per_step": (run.get("tokens_per_step") or {}).get("median"),
        "tokens_per_s": None if not engine_ms_per_token else 1e3 / engine_ms_per_token,
        "speedup": None if not engine_ms_per_token else t_ar / engine_ms_per_token,
    }
    datasets = {}
    for dataset in settings["datasets"]:
        metrics = metrics_by_key.get((served, dataset)) if served else None
        tau = _tau(metrics, method)
        entry_ = {
            "drafter": served,
            "method": method,
            "tau_token_weighted": tau,
            "source": labels.USER_SGLANG,
            "t_ar_ms": t_ar,
            "t_step_ms": t_step,
            "predicted_speedup": None if tau is None else tau * t_ar / t_step,
        }
        entry_["predicted_tokens_per_s"] = (
            None if entry_["predicted_speedup"] is None else entry_["predicted_speedup"] * 1e3 / t_ar
        )
        temperature = float(dataset_sampling(metrics or {}).get("temperature") or 0.0)
        if temperature != 0.0:  # the profile's requests are greedy: the engine's acceptance is not this dataset's
            entry_["engine_comparable"] = (
                f"no: the profile's requests are greedy, this dataset samples at T = {temperature:g}"
            )
        elif entry_["predicted_tokens_per_s"] and engine["tokens_per_s"]:
            entry_["engine_over_predicted"] = engine["tokens_per_s"] / entry_["predicted_tokens_per_s"]
        if metrics is not None:
            entry_["our_estimate"] = estimate(metrics, block)
        datasets[dataset] = entry_
    return {
        "source": labels.USER_SGLANG,
        "measured": PROFILED,
        "file_source": profile.get("source"),
        "measured_at": profile.get("measured_at"),
        "block_size": block,
        "max_new_tokens": profile.get("max_new_tokens"),
        "t_ar_ms": t_ar,
        "t_step_ms": t_step,
        "t_step_from": profile.get("t_step_from"),
        "settings": [
            {
                key: s.get(key)
                for key in (
                    "name",
                    "SGLANG_SIMULATE_ACC_LEN",
                    "requests",
                    "restart_s",
                    "decode_ms_per_token",
                    "ms_per_step",
                    "tokens_per_step",
                )
            }
            for s in profile["settings"]
        ],
        "engine": engine,
        "datasets": datasets,
    }


def _spread(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "–"
    ci = stats.get("ci95")
    return f"{stats['median']:.3g} ms" + (
        f" ({ci[0]:.3g}..{ci[1]:.3g})" if ci else f" (n {stats['n']}: min..max {stats['min']:.3g}..{stats['max']:.3g})"
    )


def _x(value: Any) -> str:
    return "–" if value is None else f"{value:.2f}×"


def profile_lines(panel: dict[str, Any] | None) -> list[str]:
    """summary.md's section for profile_panel (nothing without a profile-server file)."""
    if not panel:
        return []
    engine = panel["engine"]
    out = [
        "### Measured on your server: profile-server",
        "",
        f"{PROFILED}. Per setting: decode ms per token and ms per verify step, median over the requests with its "
        f"distribution-free 95% CI (min..max where fewer than 6 requests give none), tokens per step, and how "
        f"long the restart took. T_AR = {panel['t_ar_ms']:.3g} ms (no speculation), T_step(b{panel['block_size']}) = "
        f"{panel['t_step_ms']:.3g} ms ({panel['t_step_from']}).",
        "",
        "| setting | SGLANG_SIMULATE_ACC_LEN | requests | restart | decode ms / token | ms / verify step "
        "| tokens / step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in panel["settings"]:
        length = s.get("SGLANG_SIMULATE_ACC_LEN")
        out.append(
            "| "
            + " | ".join(
                [
                    s["name"],
                    "–" if length is None else f"{length:g}",
                    str(s["requests"]),
                    "restored by the pause" if s.get("restart_s") is None else f"{s['restart_s']:.1f} s",
                    _spread(s.get("decode_ms_per_token")),
                    _spread(s.get("ms_per_step")),
                    "–" if not s.get("tokens_per_step") else f"{s['tokens_per_step']['median']:.3g}",
                ]
            )
            + " |"
        )
    out += [
        "",
        f"Per dataset, the served drafter's chain at the served block: the speedup predicted from this profile "
        f"({labels.USER_SGLANG}: offline token-weighted tau x T_AR / T_step) and the tokens/s it implies, beside "
        f"the engine's own tokens/s and speedup over T_AR for the served configuration ({ENGINE}, the `served` "
        f"setting: its own acceptance, {engine['tokens_per_step'] or 0:.3g} tokens per step on the profile's "
        "prompts), and our estimate with its source.",
        "",
        "| dataset | served drafter | method | tau (offline) | predicted speedup | predicted tokens/s "
        "| engine tokens/s | engine speedup | engine / predicted | our estimate | our estimate's source |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for dataset, e in panel["datasets"].items():
        ours = e.get("our_estimate") or {}
        mine = _x(ours.get("expected_speedup")) if ours.get("available") else f"none: {ours['why']}" if ours else "–"
        out.append(
            "| "
            + " | ".join(
                [
                    dataset,
                    e["drafter"] or "–",
                    e["method"],
                    "–" if e["tau_token_weighted"] is None else f"{e['tau_token_weighted']:.3f}",
                    _x(e["predicted_speedup"]),
                    "–" if e["predicted_tokens_per_s"] is None else f"{e['predicted_tokens_per_s']:.4g}",
                    "–" if engine["tokens_per_s"] is None else f"{engine['tokens_per_s']:.4g}",
                    _x(engine["speedup"]),
                    f"{e['engine_over_predicted']:.3g}×"
                    if "engine_over_predicted" in e
                    else "n/a (greedy profile, sampled dataset)"
                    if "engine_comparable" in e
                    else "–",
                    mine,
                    ours.get("source", "–"),
                ]
            )
            + " |"
        )
    return out + [""]
