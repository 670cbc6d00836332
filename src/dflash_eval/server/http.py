"""The two probes of a server: one HTTP request (health, release/resume, model info) and whether its port
accepts connections. Standard library only: requests are rare and one at a time, so a client library's
sessions and pools would buy nothing."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.parse
import urllib.request

from dflash_eval.errors import DflashEvalError

KEY_SETTING = "server.api_key_env"  # the setting that names the key's environment variable


class AuthError(DflashEvalError):
    """The server refused our key (401/403): every later answer from it would be a refusal too."""


def api_key(key_env: str | None) -> str | None:
    """The API key from the environment variable `key_env` (server.api_key_env), None when unset or empty.

    The key itself never sits in a config or settings file: those are copied into logs and results.
    """
    return (os.environ.get(key_env) or None) if key_env else None


def auth_headers(key_env: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>`, SGLang's --api-key scheme (sglang/srt/utils/auth.py), or nothing."""
    key = api_key(key_env)
    return {"Authorization": f"Bearer {key}"} if key else {}


def auth_refusal(url: str, status: int, key_env: str | None) -> AuthError:
    """The error for a 401/403 from `url`, naming the setting, the variable and whether it was set."""
    name = key_env or "(none)"
    held = "holds a key the server refused" if api_key(key_env) else "is not set"
    return AuthError(
        f"{url} answered HTTP {status}: the server wants an API key and ${name} ({KEY_SETTING}) "
        f"{held}. Export the server's --api-key as ${name}, or point {KEY_SETTING} at the variable "
        "that holds it"
    )


def http_request(url: str, method: str = "GET", timeout: float = 5.0, key_env: str | None = None) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body), status 0 when nothing answered.

    A POST sends an empty JSON object: SGLang's release/resume endpoints parse the body as a request
    object and answer 422 to an empty one. With `key_env` (server.api_key_env) the key in that variable
    is sent, and a 401 or 403 raises AuthError instead of coming back as a status: a refused probe must
    not read as "this is not SGLang", nor a refused release as "the server cannot release".
    """
    data, headers = (b"{}", {"Content-Type": "application/json"}) if method == "POST" else (None, {})
    headers = {**headers, **auth_headers(key_env)}
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        if key_env is not None and exc.code in (401, 403):
            raise auth_refusal(url, exc.code, key_env) from None
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def url_port(base_url: str) -> int:
    """The TCP port of a URL, its scheme's default when it names none."""
    parts = urllib.parse.urlsplit(base_url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def port_open(base_url: str) -> bool:
    """Whether something accepts TCP connections at the URL's host and port."""
    host = urllib.parse.urlsplit(base_url).hostname or "127.0.0.1"
    try:
        with socket.create_connection((host, url_port(base_url)), timeout=1.0):
            return True
    except OSError:
        return False
