"""Samples longer than the target's max_position_embeddings: found at extraction, per sample.

The load-time check (preflight) sees only fetch.max_tokens; a long prompt plus its completion can pass
the target's positions with any max_tokens. The target still runs there (RoPE extrapolates), but its
states are off what it was built for, and SGLang refuses such a request unless its context length is
raised: the sample is not refused, but warned about by id here, recorded in the manifest (`positions`)
and counted in the report's trust section.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_LISTED = 5


def past_positions(records: list[dict[str, Any]], text_config: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The manifest's `positions` entry: {max_position_embeddings, past: [ids longer than it]}, None when the
    target's config has no such limit; a warning naming the samples when any is past it."""
    limit = text_config.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    past = [str(r["id"]) for r in records if len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) > limit]
    if past:
        more = f" and {len(past) - _LISTED} more" if len(past) > _LISTED else ""
        log.warning(
            "%d of %d samples of %s run past the target's max_position_embeddings %d (prompt + completion): "
            "%s%s; their states are extracted anyway (RoPE extrapolates) and the report counts them. Drop "
            "or shorten those prompts, or lower fetch.max_tokens, for states inside the target's positions",
            len(past),
            len(records),
            where,
            limit,
            ", ".join(past[:_LISTED]),
            more,
        )
    return {"max_position_embeddings": limit, "past": past}
