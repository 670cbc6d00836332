"""vLLM's side of the fetch protocol, as vLLM 0.34.0 speaks it (docs/vllm_protocol.md gives the source lines).

What differs from SGLang: one request flag, `return_token_ids`, returns both the prompt's and the completion's ids
(the completion's as `choices[].token_ids` on both endpoints; the prompt's in the choice on /v1/completions, at
the response level on chat); the per-request speculative metrics come back in the response's
`metrics.speculative_decoding` whenever the server was started with `--per-request-spec-decode-metrics summary`
or `detailed` (no request flag), the ordered per-step arrays only at `detailed`; and the speculative settings
are readable only from the development endpoint `/server_info` (VLLM_SERVER_DEV_MODE=1), which also carries the
sleep-mode routes the release kind uses. Kept apart from fetch.stage so that one file holds every vLLM name.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dflash_eval.server.engines import VLLM_DEV_MODE_ENV, vllm_version
from dflash_eval.server.http import http_request
from dflash_eval.vllm_protocol import VERSION

log = logging.getLogger(__name__)

# SpeculativeDecodingMetrics (entrypoints/generate/base/protocol.py), as a record's `spec` keeps them
SPEC_METRICS = (
    "num_spec_steps",
    "num_accepted_draft_tokens",
    "num_draft_tokens",
    "num_spec_tokens",
    "acceptance_histogram",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "per_step_accepted",
    "per_step_drafted",
)
# SpeculativeConfig fields read from /server_info's vllm_config.speculative_config (config/speculative.py)
SPEC_CONFIG = ("method", "model", "num_speculative_tokens", "draft_sample_method", "rejection_sample_method")
# The verification rule under which a draft is accepted iff it is the emitted token (docs/vllm_protocol.md)
EXACT_RULE = ("greedy", "standard")


def request_flags(endpoint: str) -> dict[str, Any]:
    """The extra body field that makes vLLM return the prompt's and the completion's ids (both endpoints)."""
    return {"return_token_ids": True}


def completion_token_ids(choice: dict[str, Any]) -> list[int] | None:
    """The completion's ids as vLLM returned them (`choices[].token_ids`, the stop token included)."""
    ids = choice.get("token_ids")
    return None if ids is None else [int(t) for t in ids]


def prompt_token_ids(response: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
    """The prompt's ids: in the choice on /v1/completions, at the response level on chat."""
    ids = choice.get("prompt_token_ids")
    if ids is None:
        ids = response.get("prompt_token_ids")
    return None if ids is None else [int(t) for t in ids]


def spec_metrics(response: dict[str, Any]) -> dict[str, Any] | None:
    """The request's `metrics.speculative_decoding`, None when the server sent none (per-request metrics off,
    n > 1, or no speculation). The per-step arrays are None below the `detailed` level."""
    details = (response.get("metrics") or {}).get("speculative_decoding")
    if not isinstance(details, dict):
        return None
    out = {key: details.get(key) for key in SPEC_METRICS}
    out["engine"] = "vllm"
    return out


def detected(base_url: str, key_env: str | None = None) -> str | None:
    """The vLLM version of the server at base_url, None when it does not answer /version as vLLM does."""
    return vllm_version(base_url, key_env)


def server_spec_settings(base_url: str, version: str | None, key_env: str | None = None) -> dict[str, Any]:
    """How the server speculates, in the keys every engine's record shares (speculative_algorithm,
    speculative_draft_model_path, speculative_num_draft_tokens = the block, num_speculative_tokens + 1), plus
    vLLM's own: the verification rule (draft_sample_method, rejection_sample_method) and the per-request metrics
    level. From `/server_info?config_format=json`, a development route: without VLLM_SERVER_DEV_MODE=1 it is
    404 and every setting is None, with `unknown_why` saying so (the records still fetch)."""
    check_version(version, base_url)
    out: dict[str, Any] = {
        "engine": "vllm",
        "version": version,
        "speculative_algorithm": None,
        "speculative_draft_model_path": None,
        "speculative_num_draft_tokens": None,
        **{key: None for key in SPEC_CONFIG if key not in ("method", "model")},
        "per_request_spec_decode_metrics": None,
    }
    status, body = http_request(base_url + "/server_info?config_format=json", timeout=30.0, key_env=key_env)
    try:
        info = json.loads(body) if status == 200 else None
    except ValueError:
        info = None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        out["unknown_why"] = (
            f"{base_url}/server_info answered {f'HTTP {status}' if status != 200 else 'no vllm_config'}"
            f": start vLLM with {VLLM_DEV_MODE_ENV}=1 for its speculative settings"
        )
        log.warning(
            "%s: the server's speculative settings are unknown (%s); the report cannot verify the served drafter",
            base_url,
            out["unknown_why"],
        )
        return out
    spec = config.get("speculative_config") or {}
    if spec:
        method, tokens = spec.get("method"), spec.get("num_speculative_tokens")
        out.update(
            speculative_algorithm=None if method is None else str(method).upper(),
            speculative_draft_model_path=spec.get("model"),
            speculative_num_draft_tokens=None if tokens is None else int(tokens) + 1,
            num_speculative_tokens=tokens,
            draft_sample_method=spec.get("draft_sample_method"),
            rejection_sample_method=spec.get("rejection_sample_method"),
        )
    out["per_request_spec_decode_metrics"] = (config.get("observability_config") or {}).get(
        "per_request_spec_decode_metrics"
    )
    return out


def spec_why(speculative: dict[str, Any] | None, spec: dict[str, Any] | None) -> str | None:
    """Why a vLLM record holds no per-step arrays for the online panel (a record's `spec_why`), None when it does."""
    if spec is not None and spec.get("per_step_accepted") is not None:
        return None
    speculative = speculative or {}
    level = speculative.get("per_request_spec_decode_metrics")
    if spec is not None:
        return (
            "the vLLM server runs --per-request-spec-decode-metrics summary: counts and histograms per request, "
            "no per-step arrays (those need detailed)"
        )
    if speculative.get("unknown_why") is None and speculative.get("speculative_algorithm") is None:
        return "the vLLM server does not speculate (no --speculative-config)"
    if level == "none":
        return (
            "the vLLM server runs --per-request-spec-decode-metrics none (the default): no metrics.speculative_decoding "
            "in its answers; start it with --per-request-spec-decode-metrics detailed"
        )
    return (
        "the vLLM server sent no metrics.speculative_decoding (start it with --per-request-spec-decode-metrics "
        "detailed; vLLM reports it for n == 1 only)"
    )


def sampling_warning(speculative: dict[str, Any] | None, drawn: dict[str, Any] | None) -> str | None:
    """Why offline target_only acceptance on this server's sampled completions is not its own per request, or None.

    With greedy drafts the drafter's probabilities are one-hot in the rejection test (config/speculative.py,
    draft_sample_method), so standard rejection accepts d with probability p_T(d) and on rejection draws from p_T
    with d removed: a draft is accepted iff it is the emitted token, as for SGLang's DFlash. Probabilistic drafts,
    and the block, fly (lossy) and synthetic rules, decide acceptance otherwise."""
    if drawn is None or not speculative or speculative.get("speculative_algorithm") is None:
        return None
    rule = (speculative.get("draft_sample_method"), speculative.get("rejection_sample_method"))
    if rule == EXACT_RULE:
        return None
    return (
        f"vLLM verifies with draft_sample_method={rule[0]}, rejection_sample_method={rule[1]}: only greedy "
        "drafts with standard rejection make a draft accepted iff it is the emitted token, so offline acceptance "
        "on these completions is not the server's per request (synthetic and fly are not the target's "
        "distribution at all)"
    )


def check_version(version: Any, base_url: str) -> None:
    """Warn when the server is not the vLLM release whose field names and metrics were checked."""
    if version != VERSION:
        log.warning(
            "the server at %s is vLLM %s, but fetch's field names and metric definitions were checked "
            "against vLLM %s only (docs/vllm_protocol.md): check them against this version's source",
            base_url,
            version,
            VERSION,
        )
