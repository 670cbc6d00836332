"""Online vs offline, like for like: the server's own speculative counters beside our offline steps, per request.

The two sides count the same things only once their conventions are lined up: verification steps, accepted drafts
(the server counts a last step before cutting the output), the max_tokens tail (offline shortens the last block,
SGLang verifies it full) and tau (SGLang's `spec_accept_length` also counts the prefill token). The offline steps
are the served drafter's at the served block size. vLLM's counters are compared only under greedy drafts with
standard rejection, where offline target_only is exact per request. Each rule with its source:
docs/sglang_protocol.md and docs/vllm_protocol.md. The check that the server runs the drafter we pair it with is
report/served_drafter.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dflash_eval.completions import prompt_cluster
from dflash_eval.methods import chain_method
from dflash_eval.stats import paired_difference

TAU_OURS = "tokens produced by verification steps / steps (the first completion token, from prefill, not counted)"
TAU_SGLANG = "completion tokens / steps = SGLang's spec_accept_length (the prefill token counted)"
TAU_VLLM = (
    "1 + accepted drafts / steps = vLLM's mean_acceptance_length (the bonus token counted, the prefill "
    "token not: our tau, with the last step's accepted drafts counted before the output is cut)"
)
EXACT_VLLM_RULE = ("greedy", "standard")  # draft_sample_method, rejection_sample_method


def request_counters(record: dict[str, Any]) -> dict[str, Any] | None:
    """The counters a completions record holds for one request, None without them (no speculation recorded);
    for a vLLM record without metrics, {"no_data_why": ...} (fetch.vllm's reason, for the report)."""
    spec = record.get("spec") or {}
    if spec.get("engine") == "vllm" or ((record.get("server") or {}).get("speculative") or {}).get("engine") == "vllm":
        return _vllm_counters(record, spec)
    if not spec.get("spec_verify_ct"):
        return None
    completion = (record.get("usage") or {}).get("completion_tokens")
    if completion is None:
        completion = len(record.get("completion_token_ids") or [])
    speculative = (record.get("server") or {}).get("speculative") or {}
    correct = spec.get("spec_num_correct_drafts")
    return {
        "verify_ct": int(spec["spec_verify_ct"]),
        "completion_tokens": int(completion),
        "correct_drafts": None if correct is None else int(correct),
        "histogram": [int(n) for n in spec.get("spec_correct_drafts_histogram") or []],
        "accept_length": spec.get("spec_accept_length"),
        "block_size": speculative.get("speculative_num_draft_tokens"),
        "draft_model": speculative.get("speculative_draft_model_path"),
        "max_tokens": (record.get("request") or {}).get("max_tokens"),
    }


def _vllm_counters(record: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any] | None:
    """request_counters of a vLLM record, in the same keys, plus the per-step steps (`detailed` only), what each
    step drafted, and the verification rule the server reported."""
    if not spec:
        return {"no_data_why": record.get("spec_why") or "the vLLM server sent no metrics.speculative_decoding"}
    if not spec.get("num_spec_steps"):
        return None
    completion = (record.get("usage") or {}).get("completion_tokens")
    if completion is None:
        completion = len(record.get("completion_token_ids") or [])
    speculative = (record.get("server") or {}).get("speculative") or {}
    histogram = [int(n) for n in spec.get("acceptance_histogram") or []]
    while histogram and histogram[-1] == 0:
        histogram.pop()
    accepted = spec.get("per_step_accepted")
    block = speculative.get("speculative_num_draft_tokens")
    if block is None and spec.get("num_spec_tokens") is not None:
        block = int(spec["num_spec_tokens"]) + 1  # the metrics name K themselves: known without dev mode
    return {
        "verify_ct": int(spec["num_spec_steps"]),
        "completion_tokens": int(completion),
        "correct_drafts": int(spec["num_accepted_draft_tokens"]),
        "histogram": histogram,
        "accept_length": spec.get("mean_acceptance_length"),
        "block_size": block,
        "draft_model": speculative.get("speculative_draft_model_path"),
        "max_tokens": (record.get("request") or {}).get("max_tokens"),
        "engine": "vllm",
        "steps": None if accepted is None else [int(a) + 1 for a in accepted],
        "drafted": spec.get("per_step_drafted"),
        "rule": (speculative.get("draft_sample_method"), speculative.get("rejection_sample_method")),
    }


def served_settings(record: dict[str, Any]) -> dict[str, Any] | None:
    """The speculative settings the server reported (fetch.sglang.server_spec_settings), None when none were."""
    return (record.get("server") or {}).get("speculative")


def drafts_histogram(steps: Sequence[int]) -> list[int]:
    """Steps by accepted draft tokens (step - 1), as SGLang's spec_correct_drafts_histogram."""
    if not steps:
        return []
    out = [0] * max(steps)
    for step in steps:
        out[step - 1] += 1
    return out


def last_step_only(online: list[int], offline: list[int]) -> bool:
    """Whether the online histogram is the offline one with at most one step moved to a higher bin."""
    width = max(len(online), len(offline))
    a, b = online + [0] * (width - len(online)), offline + [0] * (width - len(offline))
    delta = [x - y for x, y in zip(a, b)]
    if not any(delta):
        return True
    moved_from = [i for i, d in enumerate(delta) if d == -1]
    moved_to = [i for i, d in enumerate(delta) if d == 1]
    return sum(d != 0 for d in delta) == 2 and len(moved_from) == len(moved_to) == 1 and moved_to[0] > moved_from[0]


def shortened_from(steps: Sequence[int], block_size: int, max_tokens: int | None) -> int | None:
    """The first offline step whose block the max_tokens budget shortened, None when every block was full.

    The offline loop verifies `min(B, max_tokens - generated + 1)` tokens (dflash_generate's verify_size, with
    `generated` counting the prefill token); SGLang's DFlash worker always drafts and verifies a full block and
    cuts the output afterwards (speculative/dflash_worker_v2.py: the greedy verify views the block whole,
    cutoff_verify_lens=None; managers/schedule_batch.py caps at max_new_tokens after the verify).
    """
    if max_tokens is None:
        return None
    generated = 1
    for index, step in enumerate(steps):
        if max_tokens - generated + 1 < block_size:
            return index
        generated += step
    return None


def tail_consistent(online: dict[str, Any], steps: Sequence[int], first: int, block_size: int) -> bool:
    """Whether the online counters are what full blocks give from offline step `first` on, the steps before it
    (full blocks on both sides, the same context) being equal.

    The drafter sees its block whole (non-causal within it), so a shortened block drafts other tokens than a
    full one: from `first` on the online steps may number anything from 1 to the tokens left (each step
    produces at least one), and accept between (tokens left - steps) and steps x (B - 1) drafts, raw.
    """
    head = list(steps[:first])
    left = online["completion_tokens"] - 1 - sum(head)
    tail_steps = online["verify_ct"] - first
    if not 1 <= tail_steps <= max(1, left):
        return False
    if online["correct_drafts"] is not None:
        tail_drafts = online["correct_drafts"] - (sum(head) - len(head))
        if not left - tail_steps <= tail_drafts <= tail_steps * (block_size - 1):
            return False
    head_histogram = drafts_histogram(head)
    ours = online["histogram"] + [0] * max(0, len(head_histogram) - len(online["histogram"]))
    return not online["histogram"] or all(n >= h for n, h in zip(ours, head_histogram))


def compare_request(online: dict[str, Any], steps: Sequence[int], block_size: int) -> dict[str, Any]:
    """One request's like-for-like comparison; `equal` when every counter matches as the conventions say.

    Where max_tokens shortened offline blocks (shortened_from), `equal` judges from the first such step on
    by what SGLang's full blocks allow (tail_consistent), since there the step counts may differ.
    """
    produced = sum(steps)
    offline_correct = produced - len(steps)
    histogram = drafts_histogram(steps)
    same_steps = online["verify_ct"] == len(steps)
    same_tokens = online["completion_tokens"] == produced + 1
    surplus = None if online["correct_drafts"] is None else online["correct_drafts"] - offline_correct
    drafts_ok = surplus is None or 0 <= surplus <= block_size - 1
    histogram_ok = not online["histogram"] or last_step_only(online["histogram"], histogram)
    first = shortened_from(steps, block_size, online.get("max_tokens"))
    if first is None:
        equal = same_steps and same_tokens and drafts_ok and histogram_ok
    else:
        equal = same_tokens and tail_consistent(online, steps, first, block_size)
    per_step = online.get("steps")
    if per_step is not None:  # vLLM's detailed arrays: step by step, the last (or from the tail on) as above
        head = len(steps) - 1 if first is None else first
        equal = (
            equal
            and list(per_step[:head]) == list(steps[:head])
            and (first is not None or (len(per_step) == len(steps) and 0 <= per_step[-1] - steps[-1] <= block_size - 1))
        )
    out = {
        "online_steps": online["verify_ct"],
        "offline_steps": len(steps),
        "online_correct_drafts": online["correct_drafts"],
        "offline_correct_drafts": offline_correct,
        "online_histogram": online["histogram"],
        "offline_histogram": histogram,
        "online_tau": (online["completion_tokens"] - 1) / online["verify_ct"],
        "offline_tau": produced / len(steps),
        "online_tau_sglang": online["completion_tokens"] / online["verify_ct"],
        "offline_tau_sglang": (produced + 1) / len(steps),
        "tail_shortened_from_step": first,
        "equal": equal,
        "exact": same_steps
        and same_tokens
        and surplus in (0, None)
        and online["histogram"] in ([], histogram)
        and per_step in (None, list(steps)),
    }
    if online.get("engine") == "vllm":
        out.update(
            online_mean_acceptance_length=online["accept_length"],
            offline_mean_acceptance_length=produced / len(steps),
            online_steps_list=per_step,
            drafted_full_blocks=all(int(d) == block_size - 1 for d in online.get("drafted") or []),
        )
    return out


def _pseudo_steps(total: int, count: int) -> list[int]:
    """A list of `count` steps summing to `total`: both tau conventions read only a sample's sum and length."""
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def compare(
    online: dict[str, dict[str, Any]],
    offline_by_method: dict[str, dict[str, list[int]]] | None,
    own_block: int | None,
    tolerance: float,
    bootstrap: int = 1000,
    seed: int = 0,
    sampled: bool = False,
) -> dict[str, Any]:
    """Per request and pooled, online (the server's counters) against offline (our steps) on the same samples.

    `offline_by_method`: the served drafter's per-sample steps by method ("chain-B<b>"); the served block
    size comes from the records (`speculative_num_draft_tokens`), else the drafter's own `own_block`.
    Flagged when the pooled tau (ours, z-lab mean) differs by more than `tolerance` (relative). A `sampled`
    dataset's interval resamples prompts, not records (its n draws of a prompt share its difficulty).
    """
    without = [c["no_data_why"] for c in online.values() if "no_data_why" in c]
    online = {i: c for i, c in online.items() if "no_data_why" not in c}
    result: dict[str, Any] = {
        "recorded": bool(online),
        "samples_with_stats": len(online),
        "tolerance": tolerance,
        "tau_definition": TAU_OURS,
        "tau_sglang_definition": TAU_SGLANG,
    }
    if without:
        result.update(requests_without_data=len(without), why_without_data=without[0])
    if not online:
        if without:
            result["why"] = f"the online panel has no per-request data: {without[0]}"
        return result
    vllm = any(c.get("engine") == "vllm" for c in online.values())
    if vllm:
        result["tau_vllm_definition"] = TAU_VLLM
        rules = {tuple(c["rule"]) for c in online.values()}
        result["verification_rule"] = sorted(list(r) for r in rules if r != (None, None))
        known = [r for r in rules if r != (None, None)]
        if any(r != EXACT_VLLM_RULE for r in known):
            result.update(
                compared=False,
                why=f"vLLM verified with {sorted(known)} (draft_sample_method, "
                "rejection_sample_method): only greedy drafts with standard rejection accept a draft iff "
                "it is the emitted token, so offline target_only is not the server's rule per request",
            )
        elif not known:
            result["rule_note"] = (
                "the server did not report its verification rule (no VLLM_SERVER_DEV_MODE=1): "
                "compared as greedy drafts with standard rejection, vLLM's defaults"
            )
        if any(c.get("steps") is None for c in online.values()):
            result["per_step_note"] = (
                "no per-step arrays (--per-request-spec-decode-metrics summary): compared on counts and histograms only"
            )
    taus = [(c["completion_tokens"] - 1) / c["verify_ct"] for c in online.values()]
    result["online_tau_mean_of_samples"] = sum(taus) / len(taus)
    result["online_tau_sglang_mean_of_samples"] = sum(
        c["completion_tokens"] / c["verify_ct"] for c in online.values()
    ) / len(online)
    blocks = {c["block_size"] for c in online.values() if c["block_size"] is not None}
    served_block = next(iter(blocks)) if len(blocks) == 1 else own_block
    result["served_block_size"] = served_block
    method = chain_method(served_block) if served_block is not None else None
    result["method"] = method
    steps = (offline_by_method or {}).get(method) if method else None
    if len(blocks) > 1:
        return {**result, "compared": False, "why": f"the records were served with block sizes {sorted(blocks)}"}
    if result.get("compared") is False:
        return result
    if steps is None:
        why = (
            "no offline steps of the served drafter"
            if offline_by_method is None
            else f"the served drafter was not evaluated at {method} (evaluation.block_sizes)"
        )
        return {**result, "compared": False, "why": why}
    ids = sorted(i for i in online if steps.get(i))
    if not ids:
        return {**result, "compared": False, "why": "no sample has both online counters and offline steps"}
    per_request = {i: compare_request(online[i], steps[i], int(served_block)) for i in ids}
    online_tau = [per_request[i]["online_tau"] for i in ids]
    offline_tau = [per_request[i]["offline_tau"] for i in ids]
    online_steps = {i: _pseudo_steps(online[i]["completion_tokens"] - 1, online[i]["verify_ct"]) for i in ids}
    clusters = {i: prompt_cluster(i, True) for i in ids} if sampled else None
    paired = paired_difference(online_steps, {i: steps[i] for i in ids}, bootstrap, seed, clusters=clusters)
    online_mean, offline_mean = sum(online_tau) / len(ids), sum(offline_tau) / len(ids)
    relative = abs(online_mean - offline_mean) / offline_mean if offline_mean else math.nan
    return {
        **result,
        "compared": True,
        "samples_compared": len(ids),
        "online_tau_compared": online_mean,
        "offline_tau_compared": offline_mean,
        "online_tau_sglang_compared": sum(per_request[i]["online_tau_sglang"] for i in ids) / len(ids),
        "offline_tau_sglang_compared": sum(per_request[i]["offline_tau_sglang"] for i in ids) / len(ids),
        "online_tau_token_weighted": sum(online[i]["completion_tokens"] - 1 for i in ids)
        / sum(online[i]["verify_ct"] for i in ids),
        "offline_tau_token_weighted": sum(sum(steps[i]) for i in ids) / sum(len(steps[i]) for i in ids),
        "paired_difference": paired["tau_mean_of_samples"],
        "paired_difference_token_weighted": paired["tau_token_weighted"],
        "equal_requests": sum(r["equal"] for r in per_request.values()),
        "tail_shortened_requests": sum(r["tail_shortened_from_step"] is not None for r in per_request.values()),
        "tail_step_count_differs": sum(
            r["tail_shortened_from_step"] is not None and r["online_steps"] != r["offline_steps"]
            for r in per_request.values()
        ),
        "exact_requests": sum(r["exact"] for r in per_request.values()),
        "unequal_ids": [i for i in ids if not per_request[i]["equal"]],
        "per_request": per_request,
        "relative_difference": relative,
        "beyond_tolerance": bool(relative > tolerance),
        **(
            {
                "online_mean_acceptance_length_compared": sum(
                    per_request[i]["online_mean_acceptance_length"] for i in ids
                )
                / len(ids),
                "offline_mean_acceptance_length_compared": offline_mean,
            }
            if vllm
            else {}
        ),
    }
