"""summary.md, for people: warnings first, tau with its confidence interval and the best per column in bold, the
verdicts against the reference, then the Diagnostics ("can I trust these numbers?").

The page is put together here from its sections (tau_section.py, speedup_section.py, engine_timing.py,
server_profile.py, diagnostics_section.py, trust_section.py), from the rows (report/summary.py) and the trust
panel's data (report/trust.py), so that a suspect number is impossible to miss.
"""

from __future__ import annotations

from dflash_eval.methods import REJECTION, legend
from dflash_eval.report import engine_timing, server_profile
from dflash_eval.report.diagnostics_section import diagnostics_table, evaluation_warnings
from dflash_eval.report.labels import DIGITS, HYPOTHETICAL_TREE, samples
from dflash_eval.report.metrics_files import Evaluation
from dflash_eval.report.speedup_section import speedup_lines
from dflash_eval.report.tau_section import (
    headline,
    is_tree,
    reference_table,
    tau_table,
    temperature_lines,
    verdict_table,
)
from dflash_eval.report.trust_section import ONLINE_DEFINITIONS, cache_table, online_table, outage_lines

INTRO = (
    "tau (acceptance length) = accepted draft tokens + 1 (the bonus token) per verification step, with greedy "
    "verification against the target's own greedy completions. **z-lab mean**: mean over samples of each "
    "sample's mean tau. **Token-weighted**: total tokens / total verification steps (the SGLang convention). "
    "<sub>[a, b]</sub>: 95% bootstrap confidence interval over samples. **Bold**: best in its column "
    f"(at the {DIGITS} decimals shown). {legend()}. ⚠️: see Warnings."
)


SAMPLED_INTRO = (
    "tau (acceptance length) = accepted draft tokens + 1 (the bonus token) per verification step. Every tau above "
    "the rejection section is **target_only** verification, SGLang 0.5.23's DFlash scheme, on the served "
    "completions: on a greedy dataset (T 0) the target's own greedy completions; on a sampled one (its column names "
    "the sampling) the served sampled completions, a greedy draft accepted iff it is the served token. "
)


def intro(rows: list[dict], evaluations: list[Evaluation]) -> str:
    """The page's first paragraph: what each number is under. With a sampled dataset, the scheme of each table,
    the rejection scheme when asked for, and DDTree at T > 0 marked hypothetical."""
    if not any(samples(r) for r in rows):
        return INTRO
    text = SAMPLED_INTRO + INTRO.split("completions. ", 1)[1]
    if any(e.metrics.get(REJECTION) for e in evaluations):
        text += (
            " The last section is dflash_generate's scheme (verify: rejection): its expected tau given each "
            "sampled completion, with the samples it covers."
        )
    if any(is_tree(r["method"]) and samples(r) for r in rows):
        text += " " + HYPOTHETICAL_TREE
    return text


def render(rows: list[dict], evaluations: list[Evaluation], settings: dict, panel: dict) -> str:
    """The whole summary.md: warnings first (loud), the main table, verdicts, then diagnostics and trust."""
    lines = ["# DFlash drafter evaluation", "", intro(rows, evaluations), ""]
    found = evaluation_warnings(evaluations) + panel["warnings"]
    if found:
        lines += ["## ⚠️ Warnings", ""] + [f"- {w}" for w in found] + [""]
    lines += ["## tau, z-lab mean (mean of per-sample means)", ""]
    lines += tau_table(rows, settings, "tau_mean_of_samples", "ci_low", "ci_high") + [""]
    if settings.get("reference") is not None:
        lines += [
            f"## Verdicts against the reference ({settings['reference']})",
            "",
            "Paired difference in tau (z-lab mean) on the same samples, with its 95% paired bootstrap "
            "interval: **better** or **worse** when the whole interval is above or below zero.",
            "",
        ]
        lines += verdict_table(rows, settings) + [""]
        lines += [f"## tau relative to the reference ({settings['reference']}), z-lab mean", ""]
        lines += reference_table(rows, settings) + [""]
    lines += ["## tau, token-weighted (tokens / steps)", ""]
    lines += tau_table(rows, settings, "tau_token_weighted", "ci_low_tw", "ci_high_tw") + [""]
    lines += temperature_lines(rows, panel)
    lines += speedup_lines(rows, evaluations, settings)
    lines += engine_timing.lines(panel.get("engine_timing") or {})  # the real engine's step time beside it
    lines += server_profile.profile_lines(panel.get("server_profile"))  # profile-server's, beside the estimate
    shorter = [r for r in rows if not headline(r)]
    if shorter:
        lines += [
            "## Chain drafting with shorter blocks, z-lab mean",
            "",
            "The same drafter run with blocks of n < B tokens (each its own pass; full-attention drafter "
            "layers see the whole block, so a shorter block drafts differently).",
            "",
        ]
        lines += tau_table(
            rows, settings, "tau_mean_of_samples", "ci_low", "ci_high", keep=lambda r: not headline(r)
        ) + [""]
    lines += [
        "## Diagnostics: can I trust these numbers?",
        "",
        "### Per evaluation",
        "",
        "Argmax agreement: share of completion tokens that equal the cached target's own greedy "
        "prediction; well below 100% means the cached target is not the model that served the "
        "completions. A backend mismatch means the hidden states came from other kernels than the "
        "drafter was trained with. Token mismatches at fetch: records whose token ids disagree with the "
        "server's own prompt / completion token counts.",
        "",
    ]
    lines += diagnostics_table(evaluations, panel["fetch"]) + [""]
    lines += ["### Hidden-state caches", ""] + cache_table(panel["caches"]) + [""]
    tolerance = float(settings["online_tolerance"])
    lines += [
        "### Online vs offline",
        "",
        "The server's own speculative counters (SGLang's `sglext.spec_tokens_details`) per request, beside "
        "the served drafter's offline steps at the served block size on the same samples. "
        + ONLINE_DEFINITIONS
        + f" Flagged when the two tau differ by more than {tolerance:.1%} (report.online_tolerance).",
        "",
    ]
    lines += online_table(panel["online"]) + [""]
    lines += ["### Server outages", ""] + outage_lines(panel["server"]) + [""]
    return "\n".join(lines)
