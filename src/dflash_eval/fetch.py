"""Stage 1, fetch: the target's own greedy completions, from the live server, with their token ids.

Every later number is measured against these tokens, so each record says where its ids came from
(`completion_ids_source`) and whether they agree with the server's own token counts (`token_check`).
A server that returns ids (SGLang with `return_token_ids`) is trusted as is; otherwise (transformers
serve) the text is re-encoded and the stop token appended, and the counts tell whether that held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.errors import DflashEvalError
from dflash_eval.prompts import Prompt, load_prompts, select_subset
from dflash_eval.server import ServerController, http_request

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "max_samples": None,
    "seed": 0,
    "max_tokens": 512,
    "temperature": 0.0,
    "concurrency": 4,
    "timeout_s": 600.0,
    "retries": 5,
    "endpoint": "completions",
    "chat_template_kwargs": {},
}
REQUIRED = ("dataset", "prompts", "server", "tokenizer")
ENDPOINTS = ("completions", "chat")


class FetchError(DflashEvalError):
    """A request failed for good (after the client's retries) or the server answered nonsense."""


@dataclass
class Rendered:
    """One prompt as the target sees it: chat template applied, then tokenized by us."""

    prompt: Prompt
    text: str
    ids: list[int]


@dataclass
class ServerInfo:
    base_url: str
    model: str
    model_path: str | None
    weight_version: str | None
    sglang: bool  # answers /get_model_info: accepts and returns token ids, reports meta_info

    def as_record(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "model_path": self.model_path,
            "weight_version": self.weight_version,
        }


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and reject unknown or missing keys, so that config drift is loud."""
    missing = [k for k in REQUIRED if settings.get(k) is None]
    unknown = set(settings) - set(DEFAULTS) - set(REQUIRED)
    if missing or unknown:
        raise DflashEvalError(f"fetch settings: missing {missing}, unknown {sorted(unknown)}")
    out = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    if out["endpoint"] not in ENDPOINTS:
        raise DflashEvalError(f"fetch endpoint must be one of {ENDPOINTS}, got {out['endpoint']!r}")
    out["chat_template_kwargs"] = dict(out["chat_template_kwargs"] or {})
    return out


def server_identity(base_url: str, model: str | None) -> ServerInfo:
    """Who answers at base_url: /v1/models for the model name, /get_model_info (SGLang) for path and version."""
    status, body = http_request(base_url + "/v1/models", timeout=30.0)
    served = [m["id"] for m in json.loads(body).get("data", [])] if status == 200 else []
    if model is None:
        if not served:
            raise FetchError(f"{base_url}/v1/models lists no model (HTTP {status}); set server.model")
        model = served[0]
    elif served and model not in served:
        log.warning("model %r is not among the served models %s", model, served)
    info = ServerInfo(base_url, model, model_path=model, weight_version=None, sglang=False)
    status, body = http_request(base_url + "/get_model_info", timeout=30.0)
    if status == 200:
        meta = json.loads(body)
        info.model_path = meta.get("model_path", model)
        info.weight_version = meta.get("weight_version")
        info.sglang = True
    return info


def render_prompts(tokenizer: Any, prompts: list[Prompt], chat_template_kwargs: dict[str, Any]) -> list[Rendered]:
    """Apply the target's chat template and tokenize the result exactly as the template wrote it."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            p.messages, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
        )
        # No special tokens added: the template already wrote every one the model should see.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Rendered(p, text, list(ids)))
    return out


async def request_one(client: Any, settings: dict[str, Any], info: ServerInfo, r: Rendered) -> dict[str, Any]:
    """Send one greedy request; returns the response as a plain dict (extra server fields kept)."""
    common = {"model": info.model, "max_tokens": settings["max_tokens"], "temperature": settings["temperature"]}
    extra: dict[str, Any] = {}
    if settings["endpoint"] == "completions":
        if info.sglang:
            extra["return_token_ids"] = True
        # SGLang takes the ids themselves; transformers serve only takes text (and tokenizes it itself).
        prompt: Any = r.ids if info.sglang else r.text
        resp = await client.completions.create(prompt=prompt, extra_body=extra or None, **common)
    else:
        if settings["chat_template_kwargs"]:
            extra["chat_template_kwargs"] = settings["chat_template_kwargs"]
        if info.sglang:
            extra.update(return_token_ids=True, return_prompt_token_ids=True, return_meta_info=True)
        resp = await client.chat.completions.create(
            messages=r.prompt.messages, extra_body=extra or None, **common
        )
    return resp.model_dump()


def completion_ids(choice: dict[str, Any], text: str, finish_reason: str | None, tokenizer: Any) -> tuple[list[int], str]:
    """The completion's token ids, stop token included when finish_reason is "stop", and their source."""
    if choice.get("token_ids") is not None:
        ids = [int(t) for t in choice["token_ids"]]
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


def build_record(
    resp: dict[str, Any], r: Rendered, settings: dict[str, Any], info: ServerInfo, tokenizer: Any
) -> dict[str, Any]:
    """One completions-file record (docs/contracts.md)."""
    if not resp.get("choices"):
        raise FetchError(f"prompt {r.prompt.id}: response without choices: {resp}")
    choice = resp["choices"][0]
    if settings["endpoint"] == "chat":
        message = choice.get("message") or {}
        text = message.get("content") or ""
        if message.get("reasoning_content"):
            log.warning("prompt %s: the server split off reasoning_content; `text` holds only the content", r.prompt.id)
    else:
        text = choice.get("text") or ""
    finish_reason = choice.get("finish_reason")
    usage = resp.get("usage") or {}
    ids, source = completion_ids(choice, text, finish_reason, tokenizer)
    server_prompt_ids = choice.get("prompt_token_ids")
    if server_prompt_ids is not None:
        prompt_ids = [int(t) for t in server_prompt_ids]
        prompt_match: bool | None = prompt_ids == r.ids
    else:
        prompt_ids = r.ids
        prompt_match = len(r.ids) == usage["prompt_tokens"] if "prompt_tokens" in usage else None
    meta = choice.get("meta_info") or {}
    spec = {k: meta.get(k) for k in ("spec_accept_length", "spec_verify_ct")} if "spec_verify_ct" in meta else None
    return {
        "id": r.prompt.id,
        "dataset": settings["dataset"],
        "messages": r.prompt.messages,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": ids,
        "text": text,
        "finish_reason": finish_reason,
        "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "request": {
            "model": info.model,
            "max_tokens": settings["max_tokens"],
            "temperature": settings["temperature"],
            "endpoint": settings["endpoint"],
            "chat_template_kwargs": settings["chat_template_kwargs"],
            "prompt_format": "messages" if settings["endpoint"] == "chat" else ("token_ids" if info.sglang else "text"),
        },
        "server": info.as_record(),
        "completion_ids_source": source,
        "token_check": {
            "prompt_tokens_match": prompt_match,
            "completion_tokens_match": len(ids) == usage["completion_tokens"] if "completion_tokens" in usage else None,
        },
        "spec": spec,
    }


async def fetch_all(
    rendered: list[Rendered], settings: dict[str, Any], info: ServerInfo, tokenizer: Any
) -> list[dict[str, Any]]:
    """All records, in prompt order; at most `concurrency` requests in flight.

    Timeouts and retries with exponential backoff (connection errors, 408/409/429, 5xx) are the
    openai client's own; a request that still fails fails the stage.
    """
    import openai
    from tqdm import tqdm

    for name in ("httpx", "httpx2"):  # the openai client's transport logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    sem = asyncio.Semaphore(int(settings["concurrency"]))
    client = openai.AsyncOpenAI(
        base_url=info.base_url + "/v1",
        api_key=os.environ.get("DFLASH_EVAL_API_KEY", "EMPTY"),
        timeout=float(settings["timeout_s"]),
        max_retries=int(settings["retries"]),
    )
    bar = tqdm(total=len(rendered), desc=f"fetch {settings['dataset']}", unit="prompt")

    async def one(r: Rendered) -> dict[str, Any]:
        async with sem:
            try:
                resp = await request_one(client, settings, info, r)
            except openai.APIError as exc:
                raise FetchError(f"prompt {r.prompt.id}: {exc}") from exc
        bar.update(1)
        return build_record(resp, r, settings, info, tokenizer)

    try:
        async with client:
            return list(await asyncio.gather(*(one(r) for r in rendered)))
    finally:
        bar.close()


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for the log: finish reasons, id sources, token totals and the ids of mismatching records."""
    return {
        "records": len(records),
        "finish_reason": dict(Counter(str(r["finish_reason"]) for r in records)),
        "completion_ids_source": dict(Counter(r["completion_ids_source"] for r in records)),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in records),
        "completion_tokens": sum(len(r["completion_token_ids"]) for r in records),
        "prompt_token_mismatches": [r["id"] for r in records if r["token_check"]["prompt_tokens_match"] is False],
        "completion_token_mismatches": [r["id"] for r in records if r["token_check"]["completion_tokens_match"] is False],
    }


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fetch(settings: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Run the stage: prompts → server up → greedy completions → `out`; returns the records."""
    settings = resolve_settings(settings)
    prompts = select_subset(load_prompts(settings["prompts"]), settings["max_samples"], int(settings["seed"]))
    from transformers import AutoTokenizer  # slow to import: only once the prompts are known good

    tokenizer = AutoTokenizer.from_pretrained(settings["tokenizer"])
    rendered = render_prompts(tokenizer, prompts, settings["chat_template_kwargs"])

    controller = ServerController(settings["server"])
    controller.ensure_up()
    info = server_identity(controller.base_url, controller.settings["model"])
    log.info("fetching %d prompts of %s from %s (model %s, endpoint %s)",
             len(rendered), settings["dataset"], info.base_url, info.model, settings["endpoint"])

    records = asyncio.run(fetch_all(rendered, settings, info, tokenizer))
    write_jsonl_atomic(out, records)

    summary = summarize(records)
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
    parser.add_argument("--out", required=True, type=Path, help="completions JSONL to write")


def run(args: argparse.Namespace) -> int:
    """CLI entry (the log file is the global `dflash-eval --log`)."""
    from dflash_eval.config import fetch_settings, settings_from_args

    fetch(settings_from_args(args, fetch_settings, "dataset"), args.out)
    return 0
