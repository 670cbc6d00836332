"""SGLang's side of the fetch protocol, as SGLang 0.5.23 speaks it (docs/sglang_protocol.md gives the source lines).

Three things differ from a plain OpenAI server: the request flags that make SGLang return token ids
and speculative counters, where those come back (the chat endpoint names the completion's ids
`response_token_ids`, the completions endpoint `token_ids`; the counters sit in the response's
`sglext.spec_tokens_details`), and `/get_server_info`, whose resolved server args say whether and how
the server speculates. Kept apart from fetch.stage so that one file holds every SGLang field name.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dflash_eval.server.http import http_request
from dflash_eval.sglang_protocol import (
    VERSION,  # the SGLang release these field names were read from
)

log = logging.getLogger(__name__)


# The per-request counters we record: SpecTokensDetails (protocol.py:456-467) less the capped/ragged extras.
SPEC_COUNTERS = (
    "spec_verify_ct",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
    "spec_accept_length",
    "spec_accept_rate",
)
# The engine's own timing of a request, in seconds, as meta_info names it (sglang_protocol's MetaInfo):
# e2e_latency for every finished request (tokenizer_manager.py, _handle_batch_output: finished - created, so
# queueing and prefill included); with --enable-metrics also first_token_latency (request received to the
# prefill's token), queue_time (waiting in the scheduler) and decode_throughput (tokens/s after the first).
TIMING_FIELDS = ("e2e_latency", "first_token_latency", "queue_time", "decode_throughput")
# The server args that say how the server speculates (arg_groups/fields/spec.py).
SPEC_SETTINGS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
)
# The server args that say whether sampled verification is lossless (arg_groups/fields/spec.py; 1.0 = lossless).
ACCEPT_THRESHOLDS = ("speculative_accept_threshold_single", "speculative_accept_threshold_acc")


def request_flags(endpoint: str) -> dict[str, Any]:
    """The extra body fields that make SGLang return the prompt's and the completion's ids and the counters."""
    flags: dict[str, Any] = {"return_token_ids": True, "return_spec_tokens_details": True}
    if endpoint == "chat":
        flags["return_prompt_token_ids"] = True  # also implied by return_token_ids on chat (serving_chat.py:1411)
        flags["return_meta_info"] = True  # the engine's timing: only chat has it (CompletionRequest lacks the flag)
    return flags


def engine_timing(choice: dict[str, Any], completion_tokens: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's own numbers for one request: TIMING_FIELDS as the choice's `meta_info` holds them (a key the
    server did not send is left out, never 0), beside `spec_verify_ct` (when it speculated) and the completion's
    token count. `meta_info` says whether the server sent one at all: SGLang 0.5.23 does on chat with
    return_meta_info (serving_chat.py, choice_meta_info), never on /v1/completions (no meta_info in its choice)."""
    meta_info = choice.get("meta_info")
    out: dict[str, Any] = {"meta_info": isinstance(meta_info, dict)}
    if isinstance(meta_info, dict):
        out.update({key: float(meta_info[key]) for key in TIMING_FIELDS if meta_info.get(key) is not None})
    if spec is not None:
        out["spec_verify_ct"] = int(spec["spec_verify_ct"])
    out["completion_tokens"] = int(completion_tokens)
    return out


def completion_token_ids(choice: dict[str, Any]) -> list[int] | None:
    """The completion's ids as the server returned them: `token_ids` (completions) or `response_token_ids` (chat)."""
    for key in ("token_ids", "response_token_ids"):
        if choice.get(key) is not None:
            return [int(t) for t in choice[key]]
    return None


def spec_counters(response: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any] | None:
    """The request's speculative counters, None when the server sent none (it does not speculate, or is not SGLang).

    SGLang puts them at the response level, `sglext.spec_tokens_details` (a list when n > 1); the same keys
    also appear in a chat choice's `meta_info` (with return_meta_info). Only those two: an OpenAI answer has
    no response-level `meta_info` (that is `/generate`'s, which fetch does not call).
    """
    sglext = response.get("sglext") or {}
    details = sglext.get("spec_tokens_details")
    if isinstance(details, list):
        details = details[choice.get("index", 0)] if details else None
    if not details:
        details = choice.get("meta_info") or {}
    if not details or not details.get("spec_verify_ct"):
        return None
    out = {key: details.get(key) for key in SPEC_COUNTERS}
    out["spec_correct_drafts_histogram"] = [int(n) for n in out["spec_correct_drafts_histogram"] or []]
    return out


def server_spec_settings(base_url: str, key_env: str | None = None) -> dict[str, Any] | None:
    """How the server speculates, from `/get_server_info`; None, with a loud warning, when it does not
    answer as SGLang does (a 401/403 raises server.http.AuthError instead). The acceptance thresholds come
    back apart (`server_spec_and_thresholds`): they are no part of a greedy record.

    Called only for a server that answered `/get_model_info`, so a failure here is a half-answering
    server (a proxy, another build), not "not SGLang": the warning says which probe failed and how.
    `speculative_algorithm` is None for a server that does not speculate; `version` is SGLang's own.
    """
    return server_spec_and_thresholds(base_url, key_env)[0]


def server_spec_and_thresholds(
    base_url: str, key_env: str | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """server_spec_settings' answer, and `/get_server_info`'s ACCEPT_THRESHOLDS (None where it did not answer)."""
    url = base_url + "/get_server_info"
    status, body = http_request(url, timeout=30.0, key_env=key_env)
    try:
        info = json.loads(body) if status == 200 else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        log.warning(
            "%s answered /get_model_info as SGLang does but %s answered %s: the server's speculative "
            "settings (its drafter, block size) are unknown and the report cannot verify the served drafter",
            base_url,
            url,
            f"HTTP {status}" if status != 200 else f"no JSON object: {body[:200]!r}",
        )
        return None, None
    out = {key: info.get(key) for key in SPEC_SETTINGS}
    out["version"] = info.get("version")
    check_version(out["version"], base_url)
    return out, {key: info.get(key) for key in ACCEPT_THRESHOLDS}


def sampling_warning(
    speculative: dict[str, Any] | None, thresholds: dict[str, Any] | None, drawn: dict[str, Any] | None
) -> str | None:
    """Why this server's sampled output is not the target's own distribution, or None.

    SGLang's DFlash verify accepts draft d when coin <= p(d) / threshold_acc or p(d) >= threshold_single
    (speculative/dflash_utils.py compute_dflash_sampling_correct_drafts_and_bonus, through sgl-kernel's
    tree_speculative_sampling_target_only). With both at 1.0 (the defaults) it is lossless. Below 1.0 drafts the
    target would not have sampled are accepted: a rejected draft is still never emitted, so offline target_only
    acceptance still equals the served drafter's counters per request (tests/demo/test_sampled_loop.py), but the
    completions lean toward that drafter's proposals: its tau on them is inflated, other drafters evaluated on them
    are not measured on the target's distribution, and offline and online tau cannot agree with what a lossless
    server would give. min_p > 0 is named too: the verify's distribution (build_speculative_verify_target_probs)
    applies temperature, top-k and top-p but not min_p. Greedy requests (`drawn` None) and servers that do not
    speculate are unaffected.
    """
    if drawn is None or not (speculative or {}).get("speculative_algorithm"):
        return None
    problems = []
    if thresholds is None:
        problems.append(
            "the server did not report speculative_accept_threshold_single/_acc, so whether its "
            "verification is lossless is unknown"
        )
    else:
        off = {key: value for key, value in thresholds.items() if value is None or float(value) != 1.0}
        if off:
            problems.append(
                f"{', '.join(f'{k}={v}' for k, v in off.items())} (not 1.0, lossy): the server accepts "
                "drafts the target would not have sampled, so its completions are biased toward the served "
                "drafter and tau on them (offline or online) is not the tau of the target's distribution; "
                "relaunch without --speculative-accept-threshold-single/-acc for a lossless server"
            )
    if float(drawn.get("min_p") or 0.0) > 0.0 and (speculative or {}).get("speculative_algorithm") == "DFLASH":
        problems.append(
            f"min_p {drawn['min_p']}: SGLang {VERSION}'s DFlash verification ignores min_p (only the "
            "first token, sampled at prefill, is filtered by it), so the served text is not the min_p "
            "distribution asked for (offline target_only still equals the counters)"
        )
    return "; ".join(problems) or None


def check_version(version: Any, base_url: str) -> None:
    """Warn when the server is not the SGLang release whose field names and counters were checked."""
    if version != VERSION:
        log.warning(
            "the server at %s is SGLang %s, but fetch's field names and counter definitions were checked "
            "against SGLang %s only (docs/sglang_protocol.md): check them against this version's source",
            base_url,
            version,
            VERSION,
        )
