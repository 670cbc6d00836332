"""summary.md's per-evaluation checks: the warnings that make a number suspect (backend mismatch, low argmax
agreement, skipped samples, tokens outside support) and the Diagnostics table (docs/report.md, docs/trust.md)."""

from __future__ import annotations

from pathlib import Path

from dflash_eval.methods import REJECTION
from dflash_eval.report.md_table import table_row
from dflash_eval.report.metrics_files import Evaluation
from dflash_eval.report.summary import dataset_sampling
from dflash_eval.report.trust import NOT_RECORDED

LOW_AGREEMENT = 0.95  # below this the cached target is likely not the one that served
MAX_LISTED_SKIPS = 5


def sampled_at(metrics: dict) -> float:
    """The temperature the evaluated completions were sampled at (0: greedy; NaN: several)."""
    return float(dataset_sampling(metrics).get("temperature", 0.0))


def agreement_is_low(metrics: dict) -> bool:
    """The cached target's argmax should reproduce a greedy completion; a sampled one (T > 0) leaves its argmax
    by design, so there the agreement checks nothing and is never flagged."""
    agreement = metrics["diagnostics"].get("argmax_agreement")
    return agreement is not None and agreement < LOW_AGREEMENT and sampled_at(metrics) == 0


def evaluation_warnings(evaluations: list[Evaluation]) -> list[str]:
    """Everything that makes a number suspect, one markdown line each."""
    found = []
    for evaluation in evaluations:
        metrics, (drafter, dataset) = evaluation.metrics, evaluation.key
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        if cache["backend_mismatch_allowed"]:
            found.append(
                f"**Backend mismatch**: {drafter} on {dataset} was evaluated on hidden states from the "
                f"`{cache['backend']}` kernels but trained with `{cache.get('trained_with', '?')}` ones "
                "(allowed by evaluation.allow_backend_mismatch); its tau is not the deployed one."
            )
        agreement = diagnostics.get("argmax_agreement")
        if agreement_is_low(metrics):
            found.append(
                f"**Low argmax agreement**: {drafter} on {dataset}: {agreement:.1%} of completion tokens "
                "are the cached target's own greedy choice; the cache may not come from the served model."
            )
        outside = (metrics.get(REJECTION) or {}).get("outside_support") or {}
        if outside.get("samples"):
            found.append(
                f"**Tokens outside dflash's support**: {drafter} on {dataset}: {outside['samples']} of "
                f"{outside['samples_scored']} samples ({outside['share_of_samples']:.1%}; {outside['tokens']} "
                "tokens) hold a verified token dflash's top-k/top-p filter excludes, scored as a rejection at "
                "its anchor: their expected tau under `rejection` is a lower bound."
            )
        for why in (diagnostics.get("sampled_check") or {}).get("suspect", []):
            found.append(
                f"**Sampled cache check**: {drafter} on {dataset}: {why}; the cache may not come from the served model."
            )
        if diagnostics.get("samples_skipped"):
            found.append(
                f"**Skipped samples**: {drafter} on {dataset}: {len(diagnostics['samples_skipped'])} "
                "sample(s) not evaluated (see Diagnostics)."
            )
        if int(metrics["chain"]["samples"]) == 0:
            found.append(f"**No samples**: {drafter} on {dataset} evaluated no sample; its tau is undefined.")
    return found


def plain(markdown: str) -> str:
    """A markdown line for the log."""
    return markdown.replace("**", "").replace("`", "")


def _skipped_summary(skipped: list[dict]) -> str:
    if not skipped:
        return "0"
    listed = ", ".join(f"{s.get('id')} ({s.get('why', '?')})" for s in skipped[:MAX_LISTED_SKIPS])
    more = f", … {len(skipped) - MAX_LISTED_SKIPS} more" if len(skipped) > MAX_LISTED_SKIPS else ""
    return f"**{len(skipped)}**: {listed}{more}"


def _sampled_check_text(diagnostics: dict) -> str:
    """The T > 0 cache check beside the argmax agreement (evaluate/sampled_check.py)."""
    check = diagnostics.get("sampled_check") or {}
    parts = []
    if check.get("argmax_floor") is not None:
        parts.append(f"floor {check['argmax_floor']:.1%}")
    if check.get("support_share") is not None:
        parts.append(f"{check['support_share']:.2%} of tokens in the top-k/top-p support")
    text = "; ".join(parts) or "not a check without top_k or target log-probs"
    return f"**{text} ⚠️ SUSPECT**" if check.get("suspect") else text


def _checkpoint_summary(checkpoint: dict) -> str:
    name = Path(str(checkpoint.get("path", "?"))).name
    digest = checkpoint.get("sha256")
    return f"{name} (sha256 {digest[:12]})" if digest else name


def diagnostics_table(evaluations: list[Evaluation], fetch: dict[str, dict]) -> list[str]:
    """Per evaluation: kernel backend, mismatch (loud), fetch token checks, argmax agreement, skips, checkpoint."""
    header = [
        "drafter",
        "dataset",
        "cache backend",
        "trained with",
        "backend mismatch",
        "token mismatches at fetch",
        "completion ids from",
        "argmax agreement",
        "samples",
        "skipped",
        "layer ids",
        "checkpoint",
    ]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for evaluation in evaluations:
        metrics = evaluation.metrics
        cache, diagnostics = metrics["cache"], metrics["diagnostics"]
        agreement = diagnostics.get("argmax_agreement")
        agreement_text = "n/a (no argmax stored)" if agreement is None else f"{agreement:.2%}"
        if agreement_is_low(metrics):
            agreement_text = f"**{agreement_text} ⚠️ LOW**"
        elif agreement is not None and sampled_at(metrics) != 0:
            agreement_text += f" (sampled at T {sampled_at(metrics):g}: {_sampled_check_text(diagnostics)})"
        mismatch = "**⚠️ YES (allowed)**" if cache["backend_mismatch_allowed"] else "no"
        lines.append(
            table_row(
                [
                    metrics["drafter"],
                    metrics["dataset"],
                    cache["backend"],
                    cache.get("trained_with", "?"),
                    mismatch,
                    *fetch_cells(fetch.get(metrics["dataset"]) or {}),
                    agreement_text,
                    metrics["chain"]["samples"],
                    _skipped_summary(diagnostics.get("samples_skipped") or []),
                    ", ".join(str(i) for i in metrics["layer_ids"]),
                    _checkpoint_summary(metrics.get("checkpoint") or {}),
                ]
            )
        )
    return lines


def fetch_cells(fetch: dict) -> list[str]:
    """Token mismatches and id sources of one dataset's fetch, for the per-evaluation table."""
    if not fetch.get("recorded"):
        return [NOT_RECORDED, NOT_RECORDED]
    prompt, completion = len(fetch["prompt_token_mismatches"]), len(fetch["completion_token_mismatches"])
    text = f"prompt {prompt}, completion {completion} of {fetch['records']}"
    if prompt or completion:
        text = f"**{text} ⚠️**"
    if fetch["token_check_absent"]:
        text += f"; {len(fetch['token_check_absent'])} unchecked"
    sources = ", ".join(f"{name} {count}" for name, count in fetch["completion_ids_source"].items())
    return [text, sources]
