"""The two probes of a server: one HTTP request (health, release/resume, model info) and whether its port
accepts connections. Standard library only: requests are rare and one at a time, so a client library's
sessions and pools would buy nothing."""

from __future__ import annotations

import socket
import urllib.error
import urllib.parse
import urllib.request


def http_request(url: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body), status 0 when nothing answered.

    A POST sends an empty JSON object: SGLang's release/resume endpoints parse the body as a request
    object and answer 422 to an empty one.
    """
    data, headers = (b"{}", {"Content-Type": "application/json"}) if method == "POST" else (None, {})
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
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
