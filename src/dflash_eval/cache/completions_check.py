"""Whether a hidden cache was extracted from the completions file an evaluation is given.

A cache whose manifest was edited, or a completions file given by hand that is not the cache's, would evaluate
with rc 0 and wrong numbers. So the manifest records the completions' identity (the file's sha256, and per sample
a hash of its token ids: `identities`), and evaluation checks it before any drafter work: every sample's lengths,
the file's sha256, and only when that differs the per-sample hashes (docs/trust.md).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash_eval.cache.manifest import CacheError, manifest_path
from dflash_eval.completions import TOKEN_KEYS
from dflash_eval.io_utils import sha256_file

log = logging.getLogger(__name__)

IDENTITY_KEY = "sample_tokens_sha256"  # manifest["completions"][IDENTITY_KEY]: sample id -> token_identity
_LISTED = 5


class CompletionsMismatch(CacheError):
    """The completions file given is not the one the cache was extracted from."""


def token_identity(record: dict[str, Any]) -> str:
    """sha256 of a record's prompt and completion token ids (as text: '1,2,3|4,5'): what the cache's states of
    that sample were computed from. The separator keeps a token moved across the prompt boundary visible."""
    text = "|".join(",".join(map(str, record[key])) for key in TOKEN_KEYS)
    return hashlib.sha256(text.encode()).hexdigest()


def identities(path: str | Path, records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `completions` entry: the file, its sha256 and each sample's token identity."""
    return {
        "path": str(path),
        "sha256": sha256_file(path),
        IDENTITY_KEY: {str(r["id"]): token_identity(r) for r in records},
    }


def check(
    directory: str | Path, manifest: dict[str, Any], completions: str | Path, records: dict[str, dict[str, Any]]
) -> None:
    """Raise CompletionsMismatch unless every cached sample is the one of that id in `completions`."""
    directory, completions = Path(directory), Path(completions)
    recorded = manifest.get("completions") or {}
    fix = (
        f"evaluate with the completions file the cache was built from ({recorded.get('path', 'see its manifest')}), "
        f"or rebuild the cache from this one: `snakemake --forcerun {directory}` in the workflow, or by hand "
        f"`dflash-eval extract ... --completions {completions} --out {directory}`"
    )
    where = f"{manifest_path(directory)} against {completions}"
    lengths = []
    for entry in manifest["samples"]:
        record = records.get(str(entry["id"]))
        if record is None or not all(isinstance(record.get(key), list) for key in TOKEN_KEYS):
            continue  # absent ones are judged below, by the file's identity
        prompt, total = (
            len(record["prompt_token_ids"]),
            len(record["prompt_token_ids"]) + len(record["completion_token_ids"]),
        )
        if (entry["length"], entry["prompt_len"]) != (total, prompt):
            lengths.append(
                f"{entry['id']!r} ({entry['length']} tokens, {entry['prompt_len']} of prompt, in the cache; "
                f"{total} and {prompt} in the completions)"
            )
    if lengths:
        raise CompletionsMismatch(
            f"{where}: {len(lengths)} sample(s) differ in length: {_listed(lengths)}; the "
            f"cache's manifest was edited or comes from other completions: {fix}"
        )
    if recorded.get("sha256") == sha256_file(completions):
        return
    held = recorded.get(IDENTITY_KEY)
    if not isinstance(held, dict):
        raise CompletionsMismatch(
            f"{where}: the cache was extracted from {recorded.get('path')!r} (sha256 {str(recorded.get('sha256'))[:12]}), "
            f"not this file, and predates the per-sample record ({IDENTITY_KEY}), so its samples cannot be checked "
            f"against it: {fix}"
        )
    cached = [str(entry["id"]) for entry in manifest["samples"]]
    differ = [
        i
        for i in cached
        if i in records
        and (
            not all(isinstance(records[i].get(k), list) for k in TOKEN_KEYS)
            or held.get(i) != token_identity(records[i])
        )
    ]
    absent = [i for i in cached if i not in records]
    extra = sorted(set(records) - set(cached))
    problems = [
        f"{len(ids)} {what}: {_listed(ids)}"
        for ids, what in (
            (differ, "sample(s) with other token ids"),
            (absent, "cached sample(s) not in the completions"),
            (extra, "completion(s) not in the cache"),
        )
        if ids
    ]
    if problems:
        raise CompletionsMismatch(
            f"{where}: not the completions the cache was extracted from ({'; '.join(problems)}): {fix}"
        )
    log.info(
        "%s is not the completions file %s was extracted from (sha256 differs), but every sample's token ids "
        "are the same: evaluating",
        completions,
        directory,
    )


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more
