"""`dflash-eval profile-server`: a serving profile measured on the user's own SGLang (a managed server), not ours.

Our HF profile times an eager step, which is not how SGLang runs decode; the engine's own numbers are the ones to
decide with. This restarts the managed server once per setting: without speculation (T_AR), with
`SGLANG_SIMULATE_ACC_LEN=k` for each forced acceptance length (T_step), then as configured (the engine's tokens/s).
Each times batch-1 greedy requests on SGLang's `/generate` from their meta_info. The file is a serving profile
with `engine: sglang` (cache/serving_profile.py). The server is paused around it and always restored.
How each number is computed: docs/speedup.md; the variants' launches and their clean-up: docs/server.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shlex
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dflash_eval import completions
from dflash_eval.cache.serving_profile import check_profile
from dflash_eval.config import (
    RUNTIME_HELP,
    load_config,
    profile_server_settings,
    server_settings,
    settings_from_args,
    stage_settings,
)
from dflash_eval.errors import DflashEvalError
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.server.control import ServerController, server_paused
from dflash_eval.server.foreign import SIMULATE_ENV
from dflash_eval.server.http import auth_headers, http_request
from dflash_eval.server.kinds import Managed, Variant
from dflash_eval.server.signals import sigterm_raises
from dflash_eval.speedup.labels import SERVER_PROFILE_FORMAT
from dflash_eval.stats import median_ci

log = logging.getLogger(__name__)

FORMAT = SERVER_PROFILE_FORMAT
ENGINE = "sglang"
SWITCH = SIMULATE_ENV  # speculative/spec_utils.py, read once at import: each value is a restart
SPEC_FLAG = "--speculative-"
METRICS_FLAG = "--enable-metrics"  # without it 0.5.23's meta_info has no first_token_latency


def command_without_speculation(command: str) -> str:
    """`command` with every `--speculative-*` flag and its value removed (`--flag value` or `--flag=value`): the same
    server without speculation, for T_AR. Raises when there is none to remove (it would not speculate anyway)."""
    words, kept, removed, skip = shlex.split(command), [], 0, False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word.startswith(SPEC_FLAG):
            removed += 1
            skip = "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("-")
            continue
        kept.append(word)
    if not removed:
        raise DflashEvalError(
            f"server.command has no {SPEC_FLAG}* flags, so it does not speculate and there is no "
            "step time to measure: profile_server needs the speculating server's command"
        )
    return shlex.join(kept)


RUNTIME_ENV = "DFLASH_EVAL_PROFILE_SERVER_RUNTIME"  # the rule's --runtime, read by its shell command
RUNTIME_KEYS = ("timeout_s",)  # profile_server keys that bound how long it waits, not what it measures
PORT_FLAG = re.compile(r"(--port[= ]+)\d+")


def measurement_params(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the profile, the profile_server rule's params (so Snakemake reruns it when they change): the
    server's command, its port left out, and model, and profile_server's keys but RUNTIME_KEYS. How the server is
    reached and handled (base_url, the port, health_timeout_s, stop_grace_s, ...) is `runtime`'s: changing it
    re-profiles nothing (a restart per setting, minutes on a large target)."""
    server = config["server"]
    return {
        **{k: v for k, v in config["profile_server"].items() if k not in RUNTIME_KEYS},
        "server": {"command": PORT_FLAG.sub(r"\1PORT", server.get("command") or ""), "model": server.get("model")},
    }


def runtime(config: dict[str, Any]) -> dict[str, Any]:
    """How the rule's job runs, passed as `--runtime` beside measurement_params: the whole server settings and
    RUNTIME_KEYS (merged over --settings)."""
    return {"server": server_settings(config), **{k: config["profile_server"][k] for k in RUNTIME_KEYS}}


def problems(config: dict[str, Any]) -> list[str]:
    """What stops profile_server.enabled at workflow load: the keys and the fix."""
    wanted = config.get("profile_server") or {}
    if not wanted.get("enabled"):
        return []
    server, out = config["server"], []
    if server["kind"] != "managed":
        out.append(
            f"profile_server.enabled needs server.kind: managed (it restarts the server once per setting), "
            f"got {server['kind']!r}: measure by hand as docs/speedup.md says, or set profile_server.enabled "
            "false"
        )
        return out
    command = server.get("command") or ""
    if SPEC_FLAG not in command:
        out.append(f"profile_server.enabled: server.command has no {SPEC_FLAG}* flags, so nothing speculates")
    for key, text in (("server.command", command), ("profile_server.command_no_spec", wanted.get("command_no_spec"))):
        if text and METRICS_FLAG not in text:
            out.append(
                f"profile_server.enabled: {key} lacks {METRICS_FLAG} (SGLang 0.5.23 reports first_token_latency "
                "only with it, and the decode time is e2e_latency minus it): add it"
            )
    if wanted.get("command_no_spec") and SPEC_FLAG in wanted["command_no_spec"]:
        out.append(f"profile_server.command_no_spec must not speculate: remove its {SPEC_FLAG}* flags")
    dataset = wanted.get("dataset")
    if dataset is not None and dataset not in config["datasets"]:
        out.append(f"profile_server.dataset {dataset!r} is not one of datasets: {', '.join(config['datasets'])}")
    return out


def profile_dataset(config: dict[str, Any]) -> str:
    """The dataset whose prompts the requests send: profile_server.dataset, else the first one."""
    return config["profile_server"].get("dataset") or next(iter(config["datasets"]))


def generate(
    base_url: str, prompt: list[int], max_new_tokens: int, timeout: float, key_env: str | None
) -> dict[str, Any]:
    """One greedy request on the native /generate (input_ids in, meta_info out); its meta_info."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    request = urllib.request.Request(
        base_url + "/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **auth_headers(key_env)},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise DflashEvalError(f"POST {base_url}/generate answered {error.code}: {error.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise DflashEvalError(f"POST {base_url}/generate failed: {error}") from None
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict) or meta.get("e2e_latency") is None:
        raise DflashEvalError(
            f"{base_url}/generate answered without meta_info.e2e_latency: not SGLang's native "
            "endpoint (0.5.23's tokenizer_manager sets it for every finished request)"
        )
    if meta.get("first_token_latency") is None:
        raise DflashEvalError(
            f"{base_url}/generate's meta_info has no first_token_latency: launch the server with "
            f"{METRICS_FLAG} (SGLang reports it only then)"
        )
    return meta


def request_numbers(meta: dict[str, Any], speculates: bool) -> dict[str, float]:
    """One request's decode time, per token and (speculating) per verify step, in ms."""
    tokens = int(meta["completion_tokens"])
    decode_s = float(meta["e2e_latency"]) - float(meta["first_token_latency"])
    if tokens < 2 or decode_s <= 0:
        raise DflashEvalError(
            f"a request produced {tokens} token(s) in {decode_s:.3g} s after its first: nothing to "
            "time (raise profile_server.max_new_tokens)"
        )
    out = {"completion_tokens": tokens, "decode_s": decode_s, "decode_ms_per_token": 1e3 * decode_s / (tokens - 1)}
    if speculates:
        steps = int(meta.get("spec_verify_ct") or 0)
        if steps < 1:
            raise DflashEvalError(
                "a speculating setting's meta_info has no spec_verify_ct: the server did not "
                "speculate (check server.command's --speculative-* flags)"
            )
        out.update(verify_steps=steps, ms_per_step=1e3 * decode_s / steps, tokens_per_step=(tokens - 1) / steps)
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, its distribution-free 95% CI (None where n < 6 gives none), min, max and n."""
    low, high = median_ci(values)
    finite = math.isfinite(low) and math.isfinite(high)
    return {
        "median": statistics.median(values),
        "ci95": [low, high] if finite else None,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def expected_steps(tokens: int, length: float, block: int) -> int | None:
    """SGLang's verify steps for a request of `tokens` under an integer forced length (None for a fractional one,
    which commits its floor or ceiling at random): the prefill gives one, each step min(k, b)."""
    if length != int(length):
        return None
    return math.ceil((tokens - 1) / min(int(length), block))


def measure(
    base_url: str,
    prompts: list[list[int]],
    options: dict[str, Any],
    key_env: str | None,
    speculates: bool,
    forced: float | None = None,
    block: int | None = None,
) -> dict[str, Any]:
    """A warm-up request, then one timed request per prompt, at batch 1 (one at a time)."""
    timeout, new = float(options["timeout_s"]), int(options["max_new_tokens"])
    generate(base_url, prompts[0], new, timeout, key_env)  # warm-up: the first request pays one-off costs
    rows = [request_numbers(generate(base_url, prompt, new, timeout, key_env), speculates) for prompt in prompts]
    if forced is not None:
        for row in rows:
            want = expected_steps(row["completion_tokens"], forced, block)
            if want is not None and row["verify_steps"] != want:
                raise DflashEvalError(
                    f"{SWITCH}={forced:g}: a request of {row['completion_tokens']} tokens took {row['verify_steps']} "
                    f"verify steps, not ceil(({row['completion_tokens']} - 1) / min({forced:g}, {block})) = {want}: "
                    "the server did not honour the switch (SGLang reads it at start-up)"
                )
    out = {
        "requests": len(rows),
        "completion_tokens": [r["completion_tokens"] for r in rows],
        "decode_ms_per_token": spread([r["decode_ms_per_token"] for r in rows]),
    }
    if speculates:
        out["ms_per_step"] = spread([r["ms_per_step"] for r in rows])
        out["tokens_per_step"] = spread([r["tokens_per_step"] for r in rows])
        out["verify_steps"] = [r["verify_steps"] for r in rows]
        out["per_request_ms_per_step"] = [r["ms_per_step"] for r in rows]
    return out


def served_block(base_url: str, key_env: str | None) -> int:
    """The block the server speculates with (/get_server_info's speculative_num_draft_tokens)."""
    status, body = http_request(base_url + "/get_server_info", timeout=30.0, key_env=key_env)
    try:
        info = json.loads(body) if status == 200 else {}
    except ValueError:
        info = {}
    block = info.get("speculative_num_draft_tokens")
    if not isinstance(block, int) or block < 1:
        raise DflashEvalError(
            f"{base_url}/get_server_info (HTTP {status}) gives no speculative_num_draft_tokens: "
            "the server does not speculate"
        )
    return block


def server_version(base_url: str, key_env: str | None) -> str | None:
    status, body = http_request(base_url + "/get_server_info", timeout=30.0, key_env=key_env)
    try:
        return json.loads(body).get("version") if status == 200 else None
    except (ValueError, AttributeError):
        return None


def variant(server: dict[str, Any], name: str, command: str, env: dict[str, str]) -> dict[str, Any]:
    """Managed settings for one setting: its command, with `env` exported first so that a compound command gets it
    too. Its log_dir stays the configured server's: the variant goes on the same record (server.pid), marked as a
    variant, so that every cleanup path finds it and none takes it for the configured server (kinds.Variant); only
    its server.log is its own (`<log_dir>/profile/<setting>/`)."""
    exports = "".join(f"export {key}={shlex.quote(value)}; " for key, value in env.items())
    return {**server, "command": exports + command}


def run_variant(
    settings: dict[str, Any], ctl: ServerController, work: Any, name: str, env: dict[str, str]
) -> tuple[Any, float]:
    """Launch one variant, wait for health, run `work(base_url)`, stop it (always); the result and the restart's s.
    A SIGKILL skips the stop: the record then names the variant and its dead launcher, and the end-of-run hook or
    the next run's start stops it."""
    server = Managed(settings, ctl.transitions, Variant(name, env))
    started = time.monotonic()
    try:
        server.start(None)
        restart_s = time.monotonic() - started
        return work(), restart_s
    finally:
        if server.live_launch():  # a variant never outlives its setting, whatever keep_running says
            server.stop(lambda how: None)


def profile(settings: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """Every setting measured, the configured server's state restored; the profile (not yet written). `settings`:
    profile_server's keys with `server` (config.stage_settings("profile_server"))."""
    server = stage_settings("server", settings["server"])
    options = settings
    if server["kind"] != "managed":
        raise DflashEvalError(
            f"profile-server needs server.kind managed (it restarts the server), got {server['kind']!r}"
        )
    base, key_env = server["base_url"], server["api_key_env"]
    plain = options.get("command_no_spec") or command_without_speculation(server["command"])
    lengths = [float(k) for k in options["acceptance_lengths"]]
    variants = [("no-speculation", plain, {}, None)] + [
        (f"acc-len-{k:g}", server["command"], {SWITCH: f"{k:g}"}, k) for k in lengths
    ]
    settings_out, block = [], None
    ctl = ServerController(server)
    was_up = ctl.is_healthy()
    with server_paused(server, work="profile") as paused:
        for name, command, env, forced in variants:
            launch = variant(server, name, command, env)

            def work(forced=forced):
                nonlocal block
                if forced is not None and block is None:
                    block = served_block(base, key_env)
                return measure(
                    base, prompts, options, key_env, speculates=forced is not None, forced=forced, block=block
                )

            numbers, restart_s = run_variant(launch, paused, work, name, env)
            settings_out.append(
                {
                    "name": name,
                    SWITCH: None if forced is None else forced,
                    "command": launch["command"],
                    "restart_s": restart_s,
                    **numbers,
                }
            )
            log.info("profile-server %s: %s", name, json.dumps(numbers["decode_ms_per_token"]))
    # the configured server, as it serves (restored above if it was up; launched here if it was down, then stopped)
    with sigterm_raises(sigint=True):
        started = time.monotonic()
        try:
            ctl.ensure_up()
            restart_s = None if was_up else time.monotonic() - started
            served = measure(base, prompts, options, key_env, speculates=True)
            version = server_version(base, key_env)
            block = served_block(base, key_env) if block is None else block
        finally:
            if not was_up and ctl.server.live_launch():
                ctl.server.stop(lambda how: None)
    settings_out.append(
        {"name": "served", SWITCH: None, "command": server["command"], "restart_s": restart_s, **served}
    )
    ar = settings_out[0]["decode_ms_per_token"]["median"]
    forced_steps = [ms for s in settings_out[1:-1] for ms in s["per_request_ms_per_step"]]
    return {
        "format": FORMAT,
        "engine": ENGINE,
        "base_url": base,
        "version": version,
        "source": f"SGLang-protocol server {base} (version {version}), measured by dflash-eval profile-server",
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "t_ar_ms": ar,
        "t_verify_ms": {"1": ar},
        "t_step_ms": {str(block): statistics.median(forced_steps)},
        "t_step_from": f"median over every forced length's requests ({SWITCH} {', '.join(f'{k:g}' for k in lengths)})",
        "block_size": block,
        "max_new_tokens": int(options["max_new_tokens"]),
        "prompt_tokens": [len(p) for p in prompts],
        "batch": 1,
        "settings": settings_out,
    }


def prompts_from(path: str | Path, count: int) -> list[list[int]]:
    """The first `count` prompts' token ids of a completions file (what fetch sent: the served template's tokens)."""
    out = []
    for _, record in completions.iter_records(Path(path)):
        out.append([int(t) for t in record["prompt_token_ids"]])
        if len(out) == count:
            break
    if not out:
        raise DflashEvalError(f"{path}: no completion records, so no prompt to time the server with")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--settings", help="profile_server's keys and `server` as JSON (what the workflow passes; docs/contracts.md)"
    )
    src.add_argument("--config", help="config.yaml, to run by hand")
    parser.add_argument("--runtime", help=RUNTIME_HELP)
    parser.add_argument(
        "--completions",
        required=True,
        help="a completions JSONL (results/completions/{dataset}.jsonl) whose prompts the requests send",
    )
    parser.add_argument("--out", required=True, help="the profile JSON to write")


def run(args: argparse.Namespace) -> int:
    if args.config:
        found = problems(load_config(args.config))
        if found:
            raise DflashEvalError(f"{args.config}: " + "; ".join(found))
    settings = settings_from_args(args, profile_server_settings)
    prompts = prompts_from(args.completions, int(settings["requests"]))
    result = profile(settings, prompts)
    check_profile(result, args.out)  # what speedup.profile would refuse is never written
    atomic_write_json(args.out, result)
    log.info("server profile written: %s (T_AR %.3g ms, T_step %s)", args.out, result["t_ar_ms"], result["t_step_ms"])
    return 0
