"""Stage 1, fetch: the target's own greedy completions, from the live server, with their token ids.

Every later number is measured against these tokens, so each record says where its ids came from
(`completion_ids_source`) and whether they agree with the server's own token counts (`token_check`).
A server that returns ids (SGLang with `return_token_ids`, fetch.sglang) is trusted as is; otherwise
(transformers serve) the text is re-encoded and the stop token appended, and the counts tell whether
that held. From a speculating SGLang each record also keeps the request's speculative counters, and
the server's speculative settings (`/get_server_info`) go into every record's `server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.config import RUNTIME_HELP, settings_from_args, stage_settings
from dflash_eval.errors import DflashEvalError, Terminated
from dflash_eval.fetch import sampling, sglang, vllm
from dflash_eval.fetch.prompts import Prompt, load_prompts, record_ids, select_subset
from dflash_eval.fetch.retry import FetchError, with_retries
from dflash_eval.fetch.settings import fetch_settings
from dflash_eval.fetch.store import PartialStore, pick_kept
from dflash_eval.provenance.identity import AUTO
from dflash_eval.provenance.stamps import write_side_stamp
from dflash_eval.server.control import ServerController
from dflash_eval.server.http import api_key, auth_refusal, http_request
from dflash_eval.server.signals import sigterm_raises

log = logging.getLogger(__name__)

__all__ = ["FetchError", "fetch"]


@dataclass
class Rendered:
    """One turn's prompt as the target sees it: chat template applied, then tokenized by us."""

    id: str  # the record id: the prompt's id, or "<prompt id>#<turn>" for turns of a multi-turn prompt
    prompt_id: str
    turn: int  # 1-based
    messages: list[dict[str, Any]]
    text: str
    ids: list[int]
    sampling: dict[str, Any] | None = None  # the record's sampling (fetch.sampling.record_sampling); None: greedy


@dataclass
class ServerInfo:
    base_url: str
    model: str
    model_path: str | None
    weight_version: str | None
    sglang: bool  # answers /get_model_info: accepts and returns token ids, reports speculative counters
    speculative: dict[str, Any] | None = (
        None  # the speculative settings (fetch.sglang / fetch.vllm server_spec_settings)
    )
    key_env: str | None = None  # server.api_key_env: the variable whose key every request sends (not recorded)
    accept_thresholds: dict[str, Any] | None = None  # speculative_accept_threshold_single/_acc (fetch.sglang)
    sampling_warning: str | None = (
        None  # why the served sampled output is not the target's distribution (fetch.sglang.sampling_warning)
    )
    engine: str = "openai"  # "sglang", "vllm" (fetch.vllm), or "openai": a plain OpenAI-compatible server

    @property
    def token_ids(self) -> bool:
        """Whether the server takes and returns token ids and gets every sampling field explicitly."""
        return self.sglang or self.engine == "vllm"

    def as_record(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "speculative": self.speculative,
        }


def load_prompt_set(settings: dict[str, Any]) -> tuple[list[Prompt], str]:
    """The prompts of a prompt file or a named preset, and how to name them in messages."""
    if settings["preset"] is not None:
        from dflash_eval.fetch.presets import load_preset

        return load_preset(
            settings["preset"], settings["source"], settings["cache_dir"]
        ), f"preset {settings['preset']}"
    return load_prompts(settings["prompts"]), str(settings["prompts"])


def _same_model(a: str, b: str) -> bool:
    """Whether two model names or paths name the same model: equal, or the same last path component
    (the server may mount the weights elsewhere, or list a hub id such as Qwen/Qwen3.6-27B)."""

    def last(x: str) -> str:
        return x.rstrip("/").rsplit("/", 1)[-1].lower()

    return a == b or last(a) == last(b)


def server_identity(
    base_url: str, model: str | None, target: str, key_env: str | None = None, engine: str = "auto"
) -> ServerInfo:
    """Who answers at base_url: /v1/models for the model name, /get_model_info (SGLang) for path and version.

    The completions must be the target's own: a server that serves another model is an error, since
    every hidden state and acceptance length computed from its completions would be silently wrong.
    The expected model is `server.model` when set (the served name), else the target's path. Every
    probe sends the key of server.api_key_env; a refusal (401/403) is an error, never "not SGLang".
    `engine` (server.engine): "auto" tells SGLang (/get_model_info) from vLLM (/version) from a plain server;
    "sglang", "vllm" or "openai" says which it must be, an error when the server does not answer as that one.
    """
    status, body = http_request(base_url + "/v1/models", timeout=30.0, key_env=key_env)
    models = json.loads(body) if status == 200 else {}
    served = [str(m["id"]) for m in models.get("data", [])]
    if model is None:
        if not served:
            raise FetchError(f"{base_url}/v1/models lists no model (HTTP {status}); set server.model")
        model = served[0]
    elif served and model not in served:
        raise FetchError(
            f"server.model is {model!r} but {base_url} serves {served}; set server.model to the served name"
        )
    info = ServerInfo(base_url, model, model_path=model, weight_version=None, sglang=False, key_env=key_env)
    if engine == "openai":
        log.info(
            "%s: server.engine is openai: completions are retokenized and no speculative counters recorded", base_url
        )
        return _checked_target(info, model, target)
    status, body = http_request(base_url + "/get_model_info", timeout=30.0, key_env=key_env)
    meta = _json_object(body) if status == 200 else None
    version = vllm.detected(base_url, key_env) if meta is None and status == 404 and engine != "sglang" else None
    if engine != "auto" and (engine == "sglang") != (meta is not None) or engine == "vllm" and version is None:
        raise FetchError(
            f"server.engine is {engine}, but {base_url} does not answer as {engine} does "
            f"(/get_model_info: HTTP {status}{'' if engine != 'vllm' else '; /version: no vLLM answer'}):"
            " set server.engine to the server's engine, or auto"
        )
    if version is not None:
        info.engine = "vllm"
        info.speculative = vllm.server_spec_settings(base_url, version, key_env)
        log.info(
            "%s is vLLM %s: token ids in and out; per-request speculative metrics from each response", base_url, version
        )
    elif meta is not None:
        info.engine = "sglang"
        info.model_path = meta.get("model_path", model)
        info.weight_version = meta.get("weight_version")
        info.sglang = True
        info.speculative, info.accept_thresholds = sglang.server_spec_and_thresholds(base_url, key_env)
    elif status != 404:  # 404: no such route, a plain OpenAI-compatible server; anything else is no answer
        raise FetchError(
            f"{base_url}/get_model_info answered {f'HTTP {status}' if status else 'nothing'}"
            f"{'' if status != 200 else ' (not a JSON object)'}, while /v1/models answered: fetch cannot tell "
            "whether this is SGLang (token ids and counters) or a plain OpenAI-compatible server (retokenized "
            "text). Fix the server, or front it with one that answers /get_model_info with 404 or as SGLang does"
        )
    else:
        log.info(
            "%s has no /get_model_info (HTTP 404) and is not vLLM: a plain OpenAI-compatible server; completions "
            "are retokenized and no speculative counters are recorded",
            base_url,
        )
    return _checked_target(info, model, target)


def _checked_target(info: ServerInfo, model: str, target: str) -> ServerInfo:
    """`info`, after checking that the server serves the configured target."""
    base_url = info.base_url
    names = {model, info.model_path or model}
    if not any(_same_model(name, target) for name in names):
        raise FetchError(
            f"the server at {base_url} serves {sorted(names)}, not the configured target {target!r}: its completions "
            "would not be the target's own. Point server.base_url at the target's server, or target.path at its model"
        )
    return info


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def render(
    tokenizer: Any, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any]
) -> tuple[str, list[int]]:
    """Apply the target's chat template and tokenize the result exactly as the template wrote it."""
    return render_all(tokenizer, [messages], chat_template_kwargs)[0]


def render_all(
    tokenizer: Any, conversations: list[list[dict[str, Any]]], chat_template_kwargs: dict[str, Any]
) -> list[tuple[str, list[int]]]:
    """render() of many conversations, the texts tokenized in one call: the tokenizer's Python layer
    then runs once, not once per prompt (about half the cost of tokenizing a short prompt)."""
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
        for m in conversations
    ]
    if not texts:
        return []
    # No special tokens added: the template already wrote every one the model should see.
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [(text, list(row)) for text, row in zip(texts, ids)]


def turn_messages(prompt: Prompt, turn: int, answers: list[str]) -> list[dict[str, Any]]:
    """The conversation that turn `turn` (1-based) answers: the prefix, earlier turns with their answers, the turn."""
    if not prompt.turns:
        return prompt.messages
    messages = list(prompt.messages)
    for question, answer in zip(prompt.turns[: turn - 1], answers):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": prompt.turns[turn - 1]}]


async def request_one(client: Any, settings: dict[str, Any], info: ServerInfo, r: Rendered) -> dict[str, Any]:
    """Send one greedy request; returns the response body as a plain dict (extra server fields kept).

    The body is parsed from the raw response: the client's parse into its pydantic model (then dumped
    back to a dict) was the largest CPU item of the stage's profile besides the HTTP transport
    (benchmarks/results/fetch_speed.md). Error statuses still raise the client's exceptions, for the retries.
    """
    import openai

    try:
        return await _request_one(client, settings, info, r)
    except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:  # not worth a retry: name the key
        raise auth_refusal(f"{info.base_url} ({r.id})", exc.status_code, info.key_env) from None


async def _request_one(client: Any, settings: dict[str, Any], info: ServerInfo, r: Rendered) -> dict[str, Any]:
    """request_one's request and parse."""
    common = {"model": info.model, "max_tokens": settings["max_tokens"], "temperature": settings["temperature"]}
    drawn, extra = sampling.request_fields(settings, r.sampling, info.token_ids)
    common.update(drawn)
    if info.sglang:
        extra.update(sglang.request_flags(settings["endpoint"]))
    elif info.engine == "vllm":
        extra.update(vllm.request_flags(settings["endpoint"]))
    if settings["endpoint"] == "completions":
        # SGLang and vLLM take the ids themselves; transformers serve only takes text (and tokenizes it itself).
        prompt: Any = r.ids if info.token_ids else r.text
        raw = await client.completions.with_raw_response.create(prompt=prompt, extra_body=extra or None, **common)
    else:
        if settings["chat_template_kwargs"]:
            extra["chat_template_kwargs"] = settings["chat_template_kwargs"]
        raw = await client.chat.completions.with_raw_response.create(
            messages=r.messages, extra_body=extra or None, **common
        )
    try:
        body = json.loads(raw.content)
    except ValueError:
        raise FetchError(f"record {r.id}: the server's answer is not JSON: {raw.content[:200]!r}") from None
    if not isinstance(body, dict):
        raise FetchError(f"record {r.id}: the server's answer is not a JSON object: {raw.content[:200]!r}")
    return body


def completion_ids(
    choice: dict[str, Any], text: str, finish_reason: str | None, tokenizer: Any, engine: str = "sglang"
) -> tuple[list[int], str]:
    """The completion's token ids, stop token included when finish_reason is "stop", and their source."""
    server_ids = vllm.completion_token_ids(choice) if engine == "vllm" else sglang.completion_token_ids(choice)
    if server_ids is not None:
        ids = server_ids
        matched = choice.get("matched_stop")
        if finish_reason == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
            ids.append(matched)
        return ids, "server"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if finish_reason == "stop":
        if tokenizer.eos_token_id is None:
            raise FetchError("finish_reason is 'stop' but the tokenizer has no eos token to append")
        ids.append(int(tokenizer.eos_token_id))
    return ids, "retokenized"


def request_params(settings: dict[str, Any], info: ServerInfo) -> dict[str, Any]:
    """What a record's completion depends on besides its messages; a kept record must match it to be reused."""
    return {
        "model": info.model,
        "max_tokens": settings["max_tokens"],
        "temperature": settings["temperature"],
        "endpoint": settings["endpoint"],
        "chat_template_kwargs": settings["chat_template_kwargs"],
        "prompt_format": "messages" if settings["endpoint"] == "chat" else ("token_ids" if info.token_ids else "text"),
        **sampling.request_identity(settings),
    }


def build_record(
    resp: dict[str, Any],
    r: Rendered,
    settings: dict[str, Any],
    info: ServerInfo,
    tokenizer: Any,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """One completions-file record (docs/contracts.md); `wall_s`: our client-side time of the request."""
    if not resp.get("choices"):
        raise FetchError(f"record {r.id}: response without choices: {resp}")
    choice = resp["choices"][0]
    if settings["endpoint"] == "chat":
        message = choice.get("message") or {}
        text = message.get("content") or ""
        if message.get("reasoning_content"):
            log.warning("record %s: the server split off reasoning_content; `text` holds only the content", r.id)
    else:
        text = choice.get("text") or ""
    finish_reason = choice.get("finish_reason")
    usage = resp.get("usage") or {}
    ids, source = completion_ids(choice, text, finish_reason, tokenizer, info.engine)
    server_prompt_ids = vllm.prompt_token_ids(resp, choice) if info.engine == "vllm" else choice.get("prompt_token_ids")
    if server_prompt_ids is not None:
        prompt_ids = [int(t) for t in server_prompt_ids]
        prompt_match: bool | None = prompt_ids == r.ids
    else:
        prompt_ids = r.ids
        prompt_match = len(r.ids) == usage["prompt_tokens"] if "prompt_tokens" in usage else None
    spec = vllm.spec_metrics(resp) if info.engine == "vllm" else sglang.spec_counters(resp, choice)
    record = {
        "id": r.id,
        "prompt_id": r.prompt_id,
        "turn": r.turn,
        "dataset": settings["dataset"],
        "messages": r.messages,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": ids,
        "text": text,
        "finish_reason": finish_reason,
        "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "request": request_params(settings, info),
        **({"sampling": r.sampling} if r.sampling is not None else {}),
        "sampling_sent": sampling.sent_fields(settings, r.sampling, info.token_ids),  # temperature: request's
        "server": info.as_record(),
        "completion_ids_source": source,
        "token_check": {
            "prompt_tokens_match": prompt_match,
            "completion_tokens_match": len(ids) == usage["completion_tokens"] if "completion_tokens" in usage else None,
        },
        "spec": spec,
        # the server's own timing (fetch.sglang.engine_timing), and ours: the client-side wall time of the
        # request (send to parsed answer, retries included), with how many requests were in flight at most
        "engine": (
            sglang.engine_timing(choice, usage.get("completion_tokens", len(ids)), spec)
            if info.engine != "vllm"
            else {"completion_tokens": int(usage.get("completion_tokens", len(ids)))}
        ),
        "client_timing": {"wall_s": wall_s, "concurrency": int(settings["concurrency"])},
    }
    if info.engine == "vllm" and (why := vllm.spec_why(info.speculative, spec)) is not None:
        record["spec_why"] = why  # for the report's online panel
    if r.sampling is not None and info.sampling_warning:
        record["sampling_warning"] = info.sampling_warning  # on every record it concerns, for the report
    return record


def reusable(
    rec: dict[str, Any] | None,
    messages: list[dict[str, Any]],
    request: dict[str, Any],
    info: ServerInfo,
    drawn: dict[str, Any] | None = None,
) -> bool:
    """Whether a record kept from an earlier run answers exactly this request of the same model (and, sampled,
    was drawn with the same parameters and seed, `drawn`)."""
    return (
        rec is not None
        and rec.get("messages") == messages
        and rec.get("request") == request
        and rec.get("sampling") == drawn
        and (rec.get("server") or {}).get("model_path") == info.model_path
        and (rec.get("server") or {}).get("weight_version") == info.weight_version
        and (rec.get("server") or {}).get("speculative") == info.speculative
    )


def kept_without_server(
    prompts: list[Prompt], settings: dict[str, Any], stored: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """Every record of the dataset from the kept ones, when they alone prove it valid; None when the server is
    needed (a record missing, or made with other settings or by another server).

    A kept record is valid when it answers this request (messages, request parameters, sampling draw) of the
    server identity it recorded; when one identity made them all, names the target and is the served model the
    settings name, nothing the server could say would change that: fetch reuses them without waking, waiting for
    or asking the server (a rerun after a code change alone). A server that changed behind the same identity is
    what `--forcerun fetch` after removing the kept records is for (docs/reruns.md)."""
    expected = expected_ids(prompts, settings)
    kept = pick_kept(stored, set(expected), {})  # the latest record of each id
    missing = [rid for rid in expected if rid not in kept]
    servers = {json.dumps(rec.get("server"), sort_keys=True) for rec in kept.values()}
    requests = {json.dumps(rec.get("request"), sort_keys=True) for rec in kept.values()}
    if missing or len(servers) != 1 or len(requests) != 1:
        why = (
            f"{len(missing)} of {len(expected)} records are not kept"
            if missing
            else "the kept records were made by several servers or requests"
        )
        log.info("fetch %s: %s; asking the server", settings["dataset"], why)
        return None
    server, request = json.loads(servers.pop()), json.loads(requests.pop())
    engine = (server.get("speculative") or {}).get("engine") or (
        "sglang" if request.get("prompt_format") == "token_ids" else "openai"
    )
    info = ServerInfo(
        str(settings["server"]["base_url"]),
        str(request.get("model")),
        server.get("model_path"),
        server.get("weight_version"),
        sglang=engine == "sglang",
        speculative=server.get("speculative"),
        engine=engine,
    )
    wanted_model = settings["server"].get("model")
    names = {info.model, info.model_path or info.model}
    if (
        (wanted_model is not None and wanted_model != info.model)
        or request != request_params(settings, info)
        or not any(_same_model(name, str(settings["tokenizer"])) for name in names)
    ):
        log.info(
            "fetch %s: the kept records answer other settings or another model; asking the server", settings["dataset"]
        )
        return None
    records: dict[str, dict[str, Any]] = {}
    for prompt in prompts:
        for rids in conversations(prompt, settings):
            answers: list[str] = []
            for turn, rid in enumerate(rids, start=1):
                rec = kept[rid]
                if not reusable(
                    rec, turn_messages(prompt, turn, answers), request, info, sampling.record_sampling(settings, rid)
                ):
                    log.info(
                        "fetch %s: kept record %s answers other messages or another draw; asking the server",
                        settings["dataset"],
                        rid,
                    )
                    return None
                records[rid] = rec
                answers.append(rec["text"])
    log.info(
        "fetch %s: all %d records reused without the server: each kept record answers these settings' request "
        "of %s (model path %s, weight version %s), the identity they all recorded",
        settings["dataset"],
        len(expected),
        info.model,
        info.model_path,
        info.weight_version,
    )
    return [records[rid] for rid in expected]


def conversations(prompt: Prompt, settings: dict[str, Any]) -> list[list[str]]:
    """A prompt's conversations, each its record ids turn by turn: one when greedy, n when sampled (the k-th
    conversation's turns all end in #s<k>: each draw answers its own earlier answers)."""
    per_turn = [sampling.sample_ids(rid, settings) for rid in record_ids(prompt)]
    return [list(ids) for ids in zip(*per_turn)]


def expected_ids(prompts: list[Prompt], settings: dict[str, Any]) -> list[str]:
    """Every record id of the dataset, in output order: prompt by prompt, each prompt's conversations in turn."""
    return [rid for p in prompts for conv in conversations(p, settings) for rid in conv]


def render_first_turns(
    prompts: list[Prompt],
    kept: dict[str, dict[str, Any]],
    request: dict[str, Any],
    info: ServerInfo,
    tokenizer: Any,
    settings: dict[str, Any],
) -> dict[str, tuple[str, list[int]]]:
    """The rendered first turn of each conversation whose first record must be fetched, by record id: known
    before any answer, so rendered together (render_all); later turns wait for the answers they quote."""
    todo: dict[str, list[dict[str, Any]]] = {}
    for prompt in prompts:
        messages = turn_messages(prompt, 1, [])
        for conv in conversations(prompt, settings):
            rid = conv[0]
            if not reusable(kept.get(rid), messages, request, info, sampling.record_sampling(settings, rid)):
                todo[rid] = messages
    return dict(zip(todo, render_all(tokenizer, list(todo.values()), settings["chat_template_kwargs"])))


class Progress:
    """tqdm bar over records, with completion tokens per second in its postfix."""

    def __init__(self, total: int, done: int, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, desc=desc, unit="rec", mininterval=0.5, smoothing=0.1)
        self.tokens = 0
        self.start = time.monotonic()

    def update(self, record: dict[str, Any]) -> None:
        self.tokens += len(record["completion_token_ids"])
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def fetch_all(
    prompts: list[Prompt],
    settings: dict[str, Any],
    info: ServerInfo,
    tokenizer: Any,
    kept: dict[str, dict[str, Any]],
    store: PartialStore,
    retry_counts: Counter[str],
) -> dict[str, dict[str, Any]]:
    """Every record of `prompts`, by id; at most `concurrency` requests in flight.

    A conversation's turns go in order, each answer feeding the next turn; conversations run side
    by side. Records in `kept` that answer the same request are reused; each new record goes to
    `store` as soon as it is built. On the first request that fails for good, the others are
    cancelled and the error raised (what finished is in the store).
    """
    import openai

    for name in ("httpx", "httpx2"):  # the openai client's transport logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    sem = asyncio.Semaphore(int(settings["concurrency"]))
    request = request_params(settings, info)
    retries, backoff_s = int(settings["retries"]), float(settings["backoff_s"])
    results: dict[str, dict[str, Any]] = {}
    # Retries are ours (counted and logged), so the client's own are off.
    client = openai.AsyncOpenAI(
        base_url=info.base_url + "/v1",
        api_key=api_key(info.key_env) or "EMPTY",
        timeout=float(settings["timeout_s"]),
        max_retries=0,
    )
    expected = expected_ids(prompts, settings)
    assumed = sum(1 for rid in expected if kept.get(rid, {}).get("request") == request)
    progress = Progress(len(expected), assumed, f"fetch {settings['dataset']}")
    first_rendered = render_first_turns(prompts, kept, request, info, tokenizer, settings)

    async def conversation(prompt: Prompt, rids: list[str]) -> None:
        answers: list[str] = []
        for turn, rid in enumerate(rids, start=1):
            messages = turn_messages(prompt, turn, answers)
            rec, drawn = kept.get(rid), sampling.record_sampling(settings, rid)
            if not reusable(rec, messages, request, info, drawn):
                if rec is not None and rec.get("request") == request:
                    progress.bar.total += 1  # counted as kept at the start, but an earlier turn changed
                text, ids = first_rendered.pop(rid, None) or render(
                    tokenizer, messages, settings["chat_template_kwargs"]
                )
                r = Rendered(rid, prompt.id, turn, messages, text, ids, drawn)
                async with sem:
                    sent = time.perf_counter()
                    resp = await with_retries(
                        lambda: request_one(client, settings, info, r),
                        f"record {rid}",
                        retries,
                        backoff_s,
                        retry_counts,
                    )
                    wall_s = time.perf_counter() - sent
                rec = build_record(resp, r, settings, info, tokenizer, wall_s)
                store.add(rec)
                progress.update(rec)
            results[rid] = rec
            answers.append(rec["text"])

    try:
        async with client, asyncio.TaskGroup() as group:
            for prompt in prompts:
                for rids in conversations(prompt, settings):
                    group.create_task(conversation(prompt, rids))
    except BaseExceptionGroup as errors:
        if errors.subgroup(Terminated) is not None:  # SIGTERM landed inside a request's task
            raise Terminated("SIGTERM") from None
        failures = [e for e in errors.exceptions if isinstance(e, DflashEvalError)]  # FetchError, AuthError
        if len(failures) < len(errors.exceptions):
            raise
        if len(failures) > 1:
            log.error("%d requests failed for good; the first: %s", len(failures), failures[0])
        raise failures[0] from None
    finally:
        progress.close()
    return results


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Keep the garbage collector off what is alive when the requests start, for the block.

    That is mostly imported libraries (transformers brings in torch: ~290k objects), none of them
    garbage; yet every full collection, about one per 500 records, walks all of them, time in which the
    event loop sends no request (benchmarks/results/fetch_speed.md). Undone at the end, so that garbage
    made before the block is collected later and repeated in-process runs leave the collector as they
    found it; left alone when the caller has frozen the heap itself (theirs to undo).
    """
    if (
        gc.get_freeze_count()
    ):  # walks the frozen objects (benchmarks/results/fetch_speed.md); instant when there are none
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for the log: finish reasons, id sources, token totals and the ids of mismatching records."""
    return {
        "records": len(records),
        "finish_reason": dict(Counter(str(r["finish_reason"]) for r in records)),
        "completion_ids_source": dict(Counter(r["completion_ids_source"] for r in records)),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in records),
        "completion_tokens": sum(len(r["completion_token_ids"]) for r in records),
        "prompt_token_mismatches": [r["id"] for r in records if r["token_check"]["prompt_tokens_match"] is False],
        "completion_token_mismatches": [
            r["id"] for r in records if r["token_check"]["completion_tokens_match"] is False
        ],
    }


def fetch(settings: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Run the stage: prompts -> server up -> greedy completions -> `out`; returns the records.

    Resumable: finished records collect in `<out>.partial` and stay there (see fetch.store); a rerun, also
    one after Snakemake removed `out`, sends only the requests whose answer is missing or was made with
    other settings, and `out` appears only once every record is there.
    """
    settings = stage_settings("fetch", settings)
    prompt_set, origin = load_prompt_set(settings)
    prompts = select_subset(
        prompt_set, settings["max_samples"], int(settings["seed"]), by_id=settings["preset"] is None
    )
    expected = expected_ids(prompts, settings)
    from transformers import (
        AutoTokenizer,  # slow to import: only once the prompts are known good
    )

    tokenizer = AutoTokenizer.from_pretrained(settings["tokenizer"])
    engine = (settings.get("server") or {}).get("engine") or AUTO  # the stamp names the engine's code it planned
    with PartialStore(Path(out)) as store:
        offline = kept_without_server(prompts, settings, store.load())
        if offline is not None:
            write_side_stamp(out, "fetch", engine)
            store.finish(offline)
    if offline is not None:
        return offline
    controller = ServerController(settings["server"])
    controller.ensure_up()
    info = server_identity(
        controller.base_url,
        controller.settings["model"],
        str(settings["tokenizer"]),
        controller.settings["api_key_env"],
        controller.settings.get("engine") or AUTO,
    )
    drawn = sampling.record_sampling(settings, "any")
    info.sampling_warning = (
        vllm.sampling_warning(info.speculative, drawn)
        if info.engine == "vllm"
        else sglang.sampling_warning(info.speculative, info.accept_thresholds, drawn)
    )
    if (defaults := sampling.defaults_warning(settings, info.token_ids)) is not None:
        log.warning("%s: %s", settings["dataset"], defaults)
    if info.sampling_warning:
        log.warning(
            "SAMPLING IS NOT LOSSLESS on this server for %s: %s (kept in every record's sampling_warning "
            "and in the report)",
            settings["dataset"],
            info.sampling_warning,
        )
    retry_counts: Counter[str] = Counter()
    started, began = time.monotonic(), time.time()
    with PartialStore(Path(out)) as store, sigterm_raises():
        kept = pick_kept(store.load(), set(expected), request_params(settings, info))
        log.info(
            "fetching %d records (%d prompts) of %s from %s (model %s, endpoint %s); %d kept from an earlier run",
            len(expected),
            len(prompts),
            settings["dataset"],
            info.base_url,
            info.model,
            settings["endpoint"],
            len(kept),
        )
        try:
            with heap_frozen():
                by_id = asyncio.run(fetch_all(prompts, settings, info, tokenizer, kept, store, retry_counts))
        except FetchError as error:  # a server stopped under the fetch: say who stopped it
            raise FetchError(f"{error}{controller.went_down_since(began)}") from error
        finally:
            log.info("fetch %s: retries %s", settings["dataset"], json.dumps(dict(retry_counts)))
        records = [by_id[rid] for rid in expected]
        write_side_stamp(out, "fetch", engine)
        store.finish(records)

    summary = summarize(records)
    if whys := [r["spec_why"] for r in records if r.get("spec_why")]:
        log.warning(
            "%s: %d of %d records lack vLLM's per-step metrics: %s (the records are kept; the report's online "
            "panel says so)",
            settings["dataset"],
            len(whys),
            len(records),
            whys[0],
        )
    summary["fetched"] = sum(1 for r in records if kept.get(r["id"]) is not r)
    summary["reused"] = len(records) - summary["fetched"]
    summary["retries"] = dict(retry_counts)
    summary["seconds"] = round(time.monotonic() - started, 2)
    log.info("fetch %s: %s", settings["dataset"], json.dumps(summary))
    for key in ("prompt_token_mismatches", "completion_token_mismatches"):
        if summary[key]:
            log.warning("%s: %d of %d records: %s", key, len(summary[key]), len(records), summary[key][:10])
    return records


# ----- CLI -----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dflash-eval [--log FILE] fetch --settings JSON --out results/completions/{dataset}.jsonl`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--settings", help="fetch settings as JSON (see docs/contracts.md)")
    src.add_argument("--config", help="config.yaml (by hand; needs --dataset)")
    parser.add_argument("--dataset", help="dataset name, with --config")
    parser.add_argument("--runtime", help=RUNTIME_HELP)
    parser.add_argument("--out", required=True, type=Path, help="completions JSONL to write")


def run(args: argparse.Namespace) -> int:
    """CLI entry (the log file is the global `dflash-eval --log`)."""
    fetch(settings_from_args(args, fetch_settings, "dataset"), args.out)
    return 0
