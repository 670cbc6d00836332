"""Test helpers for the server and fetch tests: a tiny real target model (with the character-level
tokenizer of dflash_eval.testing.fixtures), and (run as a
script) a tiny real HTTP server that starts in a fraction of a second.

Script: `python tests/support/servers.py --port P [--ignore-sigterm] [--unhealthy] [--state FILE]
[--memory-file FILE] [--child]` serves GET /health (200, or 503 with --unhealthy, or 503 while "released") and
POST /release_memory_occupation and /resume_memory_occupation. --state: the process appends
`started` once it listens, and each POST's action, so a test sees from the server's side how often it
was started and what it was asked. --memory-file: the "GPU memory in use" in MiB that a
`server.memory_probe` of `cat FILE` reads: BUSY_MIB while it holds its memory, FREE_MIB once released.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from dflash_eval.testing.fixtures import EOS, SPECIAL_TOKENS, build_tokenizer, free_port

# How far the eos row of the LM head is scaled up: large enough that some greedy completions stop
# on eos within a few tokens, small enough that others run to max_tokens (both paths get tested).
EOS_LOGIT_SCALE = 3.0


def build_tiny_target(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen3_5ForCausalLM (1 Gated DeltaNet + 1 full-attention layer) and its tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    config = Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that greedy output differs between prompts
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        # Never generate a special token other than eos (its text would vanish on decode), and make eos likelier.
        for token in SPECIAL_TOKENS + ["<unk>"]:
            if token != EOS:
                model.lm_head.weight[tok.convert_tokens_to_ids(token)] = 0.0
        model.lm_head.weight[tok.eos_token_id] *= EOS_LOGIT_SCALE
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    return out_dir


HELPER_SCRIPT = Path(__file__).resolve()
TORCH_SERVE = Path(__file__).resolve().with_name("torch_serve.py")  # transformers serve, torch Gated DeltaNet bound
BUSY_MIB, FREE_MIB = 80000, 1000
_SHARED: dict[str, object] = {}


def tiny_helper_settings(log_dir: Path, *flags: str, **overrides: object) -> dict:
    """Managed-server settings for this file run as a tiny HTTP server on a free port."""
    port = free_port()
    command = f"exec {sys.executable} {HELPER_SCRIPT} --port {port} {' '.join(flags)}"
    return {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "command": command,
        "health_timeout_s": 30.0,
        "stop_grace_s": 5.0,
        "log_dir": str(log_dir),
        **overrides,
    }


def server_config(settings: dict) -> dict:
    """The `server:` section of a config.yaml for managed-server `settings` (the keys a user writes)."""
    return {key: settings[key] for key in ("kind", "base_url", "command", "health_timeout_s", "stop_grace_s")}


def in_shell(settings: dict, directory: Path) -> dict:
    """The same managed server with its command written as most are, without `exec`: /bin/sh then stays
    the server's parent and leads its process group, and the pid on record must still be the server's."""
    return {**settings, "command": f"cd {directory} && " + settings["command"].removeprefix("exec ")}


def start_child() -> None:
    """A child process in the server's process group that outlives the server (SGLang's scheduler and
    detokenizer processes run beside it the same way): what killing the server alone leaves behind."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` still in the process table (zombies left out: they hold nothing)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if state not in ("Z", "X") and int(pgrp) == pgid:
            members.append(int(entry.name))
    return members


def check_down_around_extraction(transitions: Path) -> list[dict]:
    """Assert what the issue's "done when" asks of a run's transitions.jsonl: each extraction ran inside
    an outage that took the server down before it and saw it healthy again after it. Returns the entries."""
    entries = [json.loads(line) for line in Path(transitions).read_text().splitlines()]
    events = [e["event"] for e in entries]
    assert "extraction_start" in events, events
    for start, event in enumerate(events):
        if event != "extraction_start":
            continue
        pause = max(i for i in range(start) if events[i] == "pause")
        end = events.index("extraction_end", start)
        resume = events.index("resume", end)
        assert entries[pause]["was_up"] and "down" in events[pause:start], events
        assert "healthy" in events[end:resume] and entries[resume]["restored"], events
    return entries


def serve_lists_its_model() -> bool:
    """Whether the installed `transformers serve` lists the model it was started with at /v1/models.

    transformers 5.17's /v1/models (`ModelManager.get_gen_models`, from huggingface/transformers#42146) lists
    only the generative models of the hub cache (`huggingface_hub.scan_cache_dir`): never a model given by local
    path, and on a machine without a hub cache (a fresh container) the scan raises `CacheNotFound`, answered as
    HTTP 500. 5.24's `ModelManager.list_models` catches that and lists the served model. Read in both versions'
    source and seen on both (5.17: HTTP 500; 5.24: the model); versions between are not known, and take the
    path that works on every version (server.model set).
    """
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("transformers")) >= Version("5.24")


def shared_transformers_server(base: Path) -> dict:
    """Settings of one `transformers serve` of the tiny target, shared by every test of the session.

    Built once (the model and the settings; the server itself is launched by whoever first needs it,
    through ServerController), since each start of `transformers serve` costs seconds of imports.
    It runs with the torch Gated DeltaNet path bound (tests/support/torch_serve.py), also where fla imports.
    OMP_NUM_THREADS=1: with two cores shared by several processes, torch's default two OpenMP threads
    made a 16-token greedy request 100x slower (spin-waiting), 15 s instead of 0.1 s. HF_HUB_CACHE points at
    a directory that does not exist, so what /v1/models lists does not depend on this machine's hub cache.
    `model` is left to fetch (read from /v1/models) where `transformers serve` lists the model it serves
    (`serve_lists_its_model`), else set to the model's path.
    """
    if "settings" not in _SHARED:
        model_dir = build_tiny_target(base / "tiny-target")
        port = free_port()
        command = (
            f"HF_HUB_OFFLINE=1 HF_HUB_CACHE={base / 'no-hub-cache'} OMP_NUM_THREADS=1 "
            f"exec {sys.executable} {TORCH_SERVE} serve "
            f"--host 127.0.0.1 --port {port} --device cpu {model_dir}"
        )
        _SHARED["settings"] = {
            "kind": "managed",
            "base_url": f"http://127.0.0.1:{port}",
            "model": None if serve_lists_its_model() else str(model_dir),
            "command": command,
            "health_timeout_s": 600.0,
            "stop_grace_s": 10.0,
            "log_dir": str(base / "server-logs"),
        }
        _SHARED["model_dir"] = model_dir
    return dict(_SHARED["settings"])  # type: ignore[arg-type]


def shared_model_dir() -> Path:
    """The tiny target of `shared_transformers_server` (call that first)."""
    return _SHARED["model_dir"]  # type: ignore[return-value]


def _append(path: Path | None, line: str) -> None:
    if path is not None:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def _set_memory(path: Path | None, mib: int) -> None:
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{mib}\n")
        tmp.replace(path)


def serve(port: int, ignore_sigterm: bool, unhealthy: bool, state: Path | None, memory: Path | None) -> None:
    """Run the tiny HTTP server until killed."""
    released = [False]

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                ok = not unhealthy and not released[0]
                self._answer(200 if ok else 503, {"status": "ok" if ok else "unhealthy"})
            else:
                self._answer(404, {"detail": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            action = self.path.strip("/")
            if action not in ("release_memory_occupation", "resume_memory_occupation"):
                self._answer(404, {"detail": "not found"})
                return
            released[0] = action.startswith("release")
            _set_memory(memory, FREE_MIB if released[0] else BUSY_MIB)
            _append(state, action)
            self._answer(200, {"success": True})

        def log_message(self, *args: object) -> None:
            pass

    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    _set_memory(memory, BUSY_MIB)
    _append(state, "started")
    print(f"tiny server on {port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--unhealthy", action="store_true")
    ap.add_argument("--state", type=Path)
    ap.add_argument("--memory-file", type=Path)
    ap.add_argument("--child", action="store_true", help="start a child process that outlives the server")
    a = ap.parse_args()
    if a.child:
        start_child()
    serve(a.port, a.ignore_sigterm, a.unhealthy, a.state, a.memory_file)
    sys.exit(0)
