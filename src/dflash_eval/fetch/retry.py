"""Retries of one OpenAI-API request: exponential backoff with jitter on transient failures only.

Transient: connection errors, timeouts, HTTP 408, 429 and 5xx (a server restarting, overloaded or
stalled). Anything else from the server (400, 404, 422: a request it will never accept) is raised at
once with the server's own message, since retrying it only delays the same answer. Every retry is
counted by reason, so the stage's log says how healthy the server was.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dflash_eval.errors import DflashEvalError

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF_S = 60.0


class FetchError(DflashEvalError):
    """A request failed for good (rejected, or still failing after the retries) or the answer is unusable."""


def server_message(exc: Any) -> str:
    """The server's own explanation from an openai APIStatusError (OpenAI, SGLang, vLLM or FastAPI shape)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        for key in ("message", "detail"):
            if inner.get(key):
                return inner[key] if isinstance(inner[key], str) else str(inner[key])
    response = getattr(exc, "response", None)
    text = getattr(response, "text", "") if response is not None else ""
    return text[:1000] or str(exc)


def transient_reason(exc: BaseException) -> str | None:
    """Why `exc` is worth a retry ("timeout", "connection", "HTTP 503", ...), or None if it is not."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError) and (exc.status_code in (408, 429) or exc.status_code >= 500):
        return f"HTTP {exc.status_code}"
    return None


def backoff_delay(attempt: int, base_s: float, exc: BaseException | None = None) -> float:
    """Delay before retry number `attempt` (0-based): base * 2^attempt, capped, times a jitter in [0.5, 1]
    so that many requests failing together do not come back together. A Retry-After in seconds wins if longer."""
    delay = min(MAX_BACKOFF_S, base_s * 2.0**attempt) * random.uniform(0.5, 1.0)
    response = getattr(exc, "response", None)
    header = response.headers.get("retry-after") if response is not None else None
    if header:
        try:
            delay = max(delay, min(MAX_BACKOFF_S, float(header)))
        except ValueError:
            pass  # an HTTP date: rare from inference servers, and the backoff is bounded anyway
    return delay


async def with_retries(
    call: Callable[[], Awaitable[T]], label: str, retries: int, base_s: float, counts: Counter[str]
) -> T:
    """Await `call()` until it succeeds, retrying transient failures up to `retries` times."""
    import openai

    attempt = 0
    while True:
        try:
            return await call()
        except openai.APIError as exc:
            reason = transient_reason(exc)
            if reason is None:
                status = getattr(exc, "status_code", "?")
                raise FetchError(
                    f"{label}: the server rejected the request (HTTP {status}): {server_message(exc)}"
                ) from exc
            if attempt >= retries:
                raise FetchError(
                    f"{label}: still failing after {retries} retries ({reason}: {exc}); completed records are kept, "
                    "rerun to fetch the rest"
                ) from exc
            delay = backoff_delay(attempt, base_s, exc)
            counts[reason] += 1
            log.warning("%s: %s, retry %d of %d in %.2f s", label, reason, attempt + 1, retries, delay)
            await asyncio.sleep(delay)
            attempt += 1
