"""A key-protected server (SGLang's --api-key): the key of server.api_key_env goes with every probe, request and
memory call, and a refusal is an error naming the setting; the demo server enforces the key as SGLang's
middleware does (checked against 0.5.23's utils/auth.py when its source is at hand)."""

from __future__ import annotations

import http.server
import itertools
import sys
import threading

import pytest

from dflash_eval.config import stage_settings
from dflash_eval.demo.server import authorized
from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.retry import FetchError
from dflash_eval.server.control import ServerController
from dflash_eval.server.http import AuthError, http_request
from dflash_eval.server.kinds import server_kind
from dflash_eval.server.transitions import Transitions
from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.sglang_source import load_source_module

KEY, ENV = "s3cret-key", "H28_TEST_SGLANG_KEY"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """The demo server of the tiny target (no drafter) started with --api-key; yields its settings."""
    base = tmp_path_factory.mktemp("keyed")
    target = hs.build_tiny_target(base / "target")
    port = fixtures.free_port()
    command = (
        f"OMP_NUM_THREADS=1 exec {sys.executable} -m dflash_eval.cli demo-server "
        f"--model-path {target} --port {port} --api-key {KEY}"
    )
    settings = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "command": command,
        "health_timeout_s": 120.0,
        "stop_grace_s": 5.0,
        "log_dir": str(base / "logs"),
        "api_key_env": ENV,
    }
    controller = ServerController(settings)
    controller.ensure_up()  # /health is exempt from the key, as in SGLang
    try:
        yield {"settings": settings, "target": target, "base": base}
    finally:
        controller.stop_if_launched()


def run_fetch(keyed, tmp_path):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 2)
    return fetch.fetch(
        {
            "dataset": "t",
            "prompts": str(prompts),
            "server": keyed["settings"],
            "tokenizer": str(keyed["target"]),
            "max_tokens": 4,
            "endpoint": "completions",
        },
        tmp_path / "c.jsonl",
    )


def test_with_the_key_fetch_detects_sglang_and_gets_its_ids(keyed, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    records = run_fetch(keyed, tmp_path)
    assert [r["completion_ids_source"] for r in records] == ["server", "server"]
    assert KEY not in (tmp_path / "c.jsonl").read_text()


@pytest.mark.parametrize("value, says", [(None, "is not set"), ("wrong", "holds a key the server refused")])
def test_without_the_right_key_fetch_stops_naming_the_setting(keyed, tmp_path, monkeypatch, value, says):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    with pytest.raises(AuthError) as error:
        run_fetch(keyed, tmp_path)
    assert "/v1/models answered HTTP 401" in str(error.value)
    assert f"${ENV} (server.api_key_env) {says}" in str(error.value)


def test_the_release_kinds_memory_calls_send_the_key(keyed, monkeypatch, tmp_path):
    url = keyed["settings"]["base_url"]
    settings = stage_settings(
        "server", {"kind": "release", "base_url": url, "api_key_env": ENV, "log_dir": str(tmp_path)}
    )
    server = server_kind(settings, Transitions(tmp_path, "release", url))
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(AuthError, match="release_memory_occupation answered HTTP 401"):
        server._post("/release_memory_occupation")
    monkeypatch.setenv(ENV, KEY)
    server._post("/release_memory_occupation")
    assert http_request(url + "/health")[0] == 503  # released, as the demo server reports it
    server._post("/resume_memory_occupation")
    assert server.is_up()


def test_the_demo_server_answers_401_as_sglang_does(keyed):
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(keyed["settings"]["base_url"] + "/get_server_info")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 401 and json.loads(error.value.read()) == {"error": "Unauthorized"}


def test_the_demo_servers_key_check_is_sglangs(sglang_srt):
    """Every path, header and key of a small grid decided as 0.5.23's decide_request_auth decides a NORMAL route
    (what every route the demo serves is with --api-key only: release/resume are ADMIN_OPTIONAL, same answer)."""
    auth = load_source_module(sglang_srt / "utils/auth.py", "sglang_auth_0_5_23")
    paths = [
        "/health",
        "/health_generate",
        "/v1/models",
        "/get_server_info",
        "/v1/completions",
        "/release_memory_occupation",
        "/metrics",
        "/ready",
    ]
    headers = [None, "", f"Bearer {KEY}", f"bearer {KEY}", f"Bearer {KEY}x", KEY, f"Basic {KEY}", "Bearer"]
    for path, header, key in itertools.product(paths, headers, [None, KEY]):
        for level in (auth.AuthLevel.NORMAL, auth.AuthLevel.ADMIN_OPTIONAL):
            theirs = auth.decide_request_auth(
                method="GET", path=path, authorization_header=header, api_key=key, admin_api_key=None, auth_level=level
            )
            assert authorized(path, header, key) == theirs.allowed, (path, header, key, level)
            assert theirs.allowed or theirs.error_status_code == 401


class HalfSGLang(http.server.BaseHTTPRequestHandler):
    """Answers /v1/models; /get_model_info with `status`, /get_server_info 500."""

    status = 500

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            code, body = 200, b'{"data": [{"id": "m"}]}'
        elif self.path == "/get_model_info":
            code, body = self.status, b'{"model_path": "m"}'
        else:
            code, body = 500, b"{}"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def half_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HalfSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_failing_model_info_probe_is_an_error_not_a_plain_server(half_server, monkeypatch):
    monkeypatch.setattr(HalfSGLang, "status", 500)
    with pytest.raises(FetchError, match="/get_model_info answered HTTP 500, while /v1/models answered"):
        fetch.server_identity(half_server, None, "m", ENV)
    monkeypatch.setattr(HalfSGLang, "status", 404)
    assert fetch.server_identity(half_server, None, "m", ENV).sglang is False


def test_a_failing_server_info_probe_warns_loudly(half_server, monkeypatch, caplog):
    monkeypatch.setattr(HalfSGLang, "status", 200)
    info = fetch.server_identity(half_server, None, "m", ENV)
    assert info.sglang is True and info.speculative is None
    assert "/get_server_info answered HTTP 500" in caplog.text and "cannot verify the served drafter" in caplog.text
