"""The demo server's `--dp-size` (SGLang's flag): replicas in worker processes serve requests at once, and each
answer is the one the server computes alone, to the token and counter."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_eval.server.control import ServerController
from tests.support.demo_server import demo_server

PROMPTS = [[1, 5, 9, 13, 2], [3, 3, 7], [11, 4, 6, 8, 10, 12], [2, 9]]


def post(base_url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{base_url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def answers(base_url: str) -> list[dict]:
    """The four prompts at once: greedy, and one sampled with a seed."""
    bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": 12, "temperature": 0}} for p in PROMPTS]
    bodies[1]["sampling_params"] = {"max_new_tokens": 12, "temperature": 0.8, "sampling_seed": 7}
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: post(base_url, body), bodies))


def served(settings: dict, extra: str) -> ServerController:
    settings = {**settings, "command": f"{settings['command']} --enable-metrics {extra}".strip()}
    controller = ServerController(settings)
    controller.ensure_up()
    return controller


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same target and drafter served alone and by two replicas, one after the other (2 cores here)."""
    settings, _, _ = demo_server(tmp_path_factory.mktemp("replicas"))
    out = {}
    for name, extra in (("alone", ""), ("replicas", "--dp-size 2")):
        controller = served(settings, extra)
        try:
            out[name] = answers(settings["base_url"])
            if name == "replicas":
                out["group"] = controller.launched_pid()  # the launch's process group (start_new_session)
        finally:
            controller.stop_if_launched()
    return out


def test_replicas_answer_what_one_server_computes(both):
    for alone, replica in zip(both["alone"], both["replicas"], strict=True):
        assert replica["output_ids"] == alone["output_ids"]
        counters = ("completion_tokens", "spec_verify_ct", "spec_accept_length", "finish_reason")
        assert {k: replica["meta_info"].get(k) for k in counters} == {k: alone["meta_info"].get(k) for k in counters}


def test_two_replicas_serve_two_requests_at_once(both):
    """Of four requests sent together, the server alone makes the second wait for a whole other request; two
    replicas start two at once (the second's queue time is below the shortest request's compute time)."""

    def second_wait_and_shortest_compute(answers: list[dict]) -> tuple[float, float]:
        meta = [a["meta_info"] for a in answers]
        waits = sorted(m["queue_time"] for m in meta)
        return waits[1], min(m["e2e_latency"] - m["queue_time"] for m in meta)

    wait, compute = second_wait_and_shortest_compute(both["alone"])
    assert wait > compute  # the server alone: the second of four requests queued behind a whole other one
    wait, compute = second_wait_and_shortest_compute(both["replicas"])
    assert wait < compute, [a["meta_info"] for a in both["replicas"]]


def test_the_replicas_stop_with_the_server(both):
    """Stopping the managed server (SIGTERM to its process group) leaves no replica behind."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(both["group"], 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(both["group"], signal.SIGKILL)
    pytest.fail("a replica outlived the stopped demo server")
