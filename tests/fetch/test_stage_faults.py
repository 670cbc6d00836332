"""Fetch against real server processes that fail: killed mid-run, intermittent 500s and stalls, validation
errors, a wrong model; resume after a torn write; multi-turn prompts. The server is dflash_eval/testing/fake_openai_server.py,
a real HTTP process whose completions are a pure function of the prompt ids, so every run can be checked
against a clean run and against the server's own function."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch import sglang
from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.retry import FetchError, backoff_delay
from dflash_eval.fetch.store import PartialStore, partial_path, read_records
from dflash_eval.testing import fake_openai_server as fake_server
from dflash_eval.testing import fixtures
from tests.support import heap
from tests.support.fake_fetch import fake, fake_process, served, settings


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    fixtures.build_tokenizer(out)
    return out


def strip_url(records: list[dict]) -> list[dict]:
    """The records less what differs between two servers' runs of the same answers: the URL, and the timing
    (the server's own, where it sends any, and our client-side wall time)."""
    return [
        {
            **r,
            "server": {**r["server"], "base_url": None},
            "engine": {k: v for k, v in r["engine"].items() if k not in sglang.TIMING_FIELDS},
            "client_timing": {**r["client_timing"], "wall_s": None},
        }
        for r in records
    ]


def test_server_killed_mid_run_then_rerun_completes_the_rest(tmp_path, tokenizer_dir):
    """SIGKILL the server process from outside while 4 requests are in flight (it answers each 0.3 s late),
    then rerun against a server restarted on the same port: the rerun sends exactly the prompts that have
    no record (those in flight included), and the output equals a clean run's, without duplicates."""
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out" / "t.jsonl"
    first_log = tmp_path / "first.jsonl"
    port = fixtures.free_port()
    with fake_process(tokenizer_dir, first_log, "--delay-s", "0.3", "--log-arrivals", port=port) as (proc, url):

        def kill_mid_run() -> None:
            """SIGKILL once 8 requests were answered and others are waiting for their answers."""
            while proc.poll() is None and not fetched.is_set():
                answered = len(served(first_log))
                if answered >= 8 and len(served(first_log, "arrived")) > answered:
                    proc.send_signal(signal.SIGKILL)
                time.sleep(0.01)

        fetched = threading.Event()
        killer = threading.Thread(target=kill_mid_run)
        killer.start()
        try:
            with pytest.raises(FetchError, match="still failing after 1 retries"):
                fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts, retries=1), out)
        finally:
            fetched.set()
            killer.join()
        assert proc.wait() == -signal.SIGKILL
    assert not out.exists()
    first = read_records(partial_path(out))
    kept = [int(r["id"][1:]) for r in first]
    answered, arrived = served(first_log), served(first_log, "arrived")
    in_flight = set(arrived) - set(answered)
    assert in_flight, "no request was in flight when the server was killed"
    assert len(kept) == len(set(kept)) and set(kept) <= set(answered)  # a record only for an answer, once
    assert len(kept) >= len(answered) - 4  # at most the 4 requests in flight are lost

    log = tmp_path / "requests.jsonl"
    with fake(tokenizer_dir, None) as clean_url:
        clean = fetch.fetch(settings(tmp_path, clean_url, tokenizer_dir, prompts), tmp_path / "clean.jsonl")
    with fake_process(tokenizer_dir, log, port=port) as (_, url):
        records = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    rerun = served(log)
    assert sorted(rerun) == sorted(set(range(24)) - set(kept))  # the rerun sent exactly the missing prompts,
    assert in_flight <= set(rerun)  # the lost ones among them, each once
    assert [r["id"] for r in records] == [f"p{i}" for i in range(24)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert strip_url(records) == strip_url(clean)  # nothing lost, nothing duplicated, same answers
    assert os.path.samefile(partial_path(out), out)  # kept, as a link of the output, for the next rerun


# Quarantined from the default run: in two full-suite runs on fresh clones (2026-12-02) the command either
# exited 0 (16 prompts) or did not exit within 30 s of the signal (48 prompts), while it passed alone. A likely
# cause, found since: SIGTERM raised Terminated from a Python handler, and where that landed inside one of asyncio's
# callbacks the loop caught and logged it (the signal lost: the fetch ran on, or a request was left half read);
# tests/server/test_signals.py shows it. While a loop runs, sigterm_raises now cancels its tasks instead. Not
# yet seen passing in a full-suite run, so it stays out of it: `python -m pytest -m slow -k sigterm`.
@pytest.mark.slow
def test_sigterm_to_the_fetch_command_keeps_what_it_finished_and_says_so(tmp_path, tokenizer_dir):
    """What scancel or a Snakemake cancel sends: the command flushes its finished records, exits 143 at once
    with one line (no traceback), and a rerun sends only the prompts without a record. Enough prompts that the
    signal lands mid-run on a fast machine too (10 waves of 0.3 s at concurrency 4 after the 6th answer)."""
    prompt_count = 48
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", prompt_count)
    out = tmp_path / "out" / "t.jsonl"
    log = tmp_path / "requests.jsonl"
    with fake_process(tokenizer_dir, log, "--delay-s", "0.3") as (_, url):
        # stderr to a file, not a pipe: a pipe nobody reads until the end fills up and blocks the command
        errors = tmp_path / "stderr.txt"
        with errors.open("w") as sink:
            command = subprocess.Popen(
                [
                    "dflash-eval",
                    "fetch",
                    "--settings",
                    json.dumps(settings(tmp_path, url, tokenizer_dir, prompts)),
                    "--out",
                    str(out),
                ],
                stderr=sink,
                text=True,
            )
        deadline = time.monotonic() + 60
        while len(served(log)) < 6:
            assert command.poll() is None and time.monotonic() < deadline, errors.read_text()
            time.sleep(0.02)
        sent, answered = time.monotonic(), len(served(log))
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=30) == 128 + signal.SIGTERM, errors.read_text()[-3000:]
        assert time.monotonic() - sent < 5
        stderr = errors.read_text()
    assert "fetch stopped by SIGTERM; what it finished is kept" in stderr and "Traceback" not in stderr, stderr
    kept = [int(r["id"][1:]) for r in read_records(partial_path(out))]
    # Answers still on their way to the client (at most the 4 in flight) may be lost, nothing else.
    assert len(kept) >= answered - 4 and len(kept) == len(set(kept)) and set(kept) <= set(served(log))
    rerun_log = tmp_path / "rerun.jsonl"
    with fake(tokenizer_dir, rerun_log) as url:
        records = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    assert sorted(served(rerun_log)) == sorted(set(range(prompt_count)) - set(kept))
    assert [r["id"] for r in records] == [f"p{i}" for i in range(prompt_count)]


def test_intermittent_500_and_timeouts_are_retried_and_counted(tmp_path, tokenizer_dir, caplog):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 24)
    log = tmp_path / "requests.jsonl"
    caplog.set_level(logging.INFO)
    with fake(tokenizer_dir, log, "--fail-every", "4", "--stall-every", "7", "--stall-s", "5") as url:
        records = fetch.fetch(
            settings(tmp_path, url, tokenizer_dir, prompts, timeout_s=2.0, retries=4), tmp_path / "o.jsonl"
        )
    with fake(tokenizer_dir) as url:
        clean = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / "clean.jsonl")
    assert [r["id"] for r in records] == [f"p{i}" for i in range(24)]
    assert strip_url(records) == strip_url(clean)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    attempts = len({r["n"] for r in rows})
    n_500 = sum(r["status"] == 500 for r in rows)
    n_stall = sum(r["status"] == "stall" for r in rows)
    assert n_500 >= 4 and n_stall >= 2
    [summary, _] = [json.loads(m.split(": ", 1)[1]) for m in caplog.messages if m.startswith("fetch t: {")]
    # Every failed attempt was retried and counted: each 500, and each timeout (every stall, plus any
    # answer slower than the timeout on a loaded machine); the server saw at least the 24 good attempts.
    assert summary["retries"]["HTTP 500"] == n_500
    assert summary["retries"]["timeout"] >= n_stall and attempts >= 24 + n_500 + n_stall
    assert any(re.match(r"record p\d+: HTTP 500, retry 1 of 4 in", m) for m in caplog.messages)


def test_validation_error_is_not_retried_and_names_the_servers_message(tmp_path, tokenizer_dir):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 10)
    log = tmp_path / "requests.jsonl"
    with fake(tokenizer_dir, log, "--reject-max-tokens-over", "8") as url:
        with pytest.raises(FetchError, match=r"rejected the request \(HTTP 400\): max_tokens must be at most 8"):
            fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts, concurrency=2), tmp_path / "o.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert 1 <= len(rows) <= 2 and {r["status"] for r in rows} == {400}  # no retry, the rest cancelled


def test_malformed_prompt_file_fetches_nothing(tmp_path, tokenizer_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "turns": []}\n')
    log = tmp_path / "requests.jsonl"
    out = tmp_path / "o.jsonl"
    with fake(tokenizer_dir, log) as url:
        with pytest.raises(DflashEvalError, match=rf"{re.escape(str(prompts))}:2: \"turns\" must be a non-empty list"):
            fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    assert log.read_text() == "" and not out.exists() and not partial_path(out).exists()


def test_torn_last_line_is_dropped_and_refetched(tmp_path, tokenizer_dir, caplog):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 6)
    out = tmp_path / "o.jsonl"
    log = tmp_path / "requests.jsonl"
    with fake(tokenizer_dir, log) as url:
        clean = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
        lines = out.read_text().splitlines(keepends=True)
        partial_path(out).write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # killed mid-write
        out.unlink()
        with caplog.at_level(logging.WARNING):
            again = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    assert any("dropping a torn last line" in m for m in caplog.messages)
    assert sorted(served(log)[6:]) == [4, 5]  # the torn record and the one after it, in whichever order (concurrency)
    assert again[:4] == clean[:4] and strip_url(again) == strip_url(clean)  # the refetched: timing aside


def test_changed_settings_refetch_instead_of_reusing(tmp_path, tokenizer_dir):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "o.jsonl"
    log = tmp_path / "requests.jsonl"
    with fake(tokenizer_dir, log) as url:
        fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
        partial_path(out).write_text(out.read_text())  # as if interrupted before the rename
        out.unlink()
        records = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts, max_tokens=4), out)
    assert sorted(served(log)) == [0, 0, 1, 1, 2, 2]
    assert all(r["request"]["max_tokens"] == 4 and len(r["text"]) <= 4 for r in records)


def test_a_server_of_another_model_is_an_error(tmp_path, tokenizer_dir):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 2)
    with fake(tokenizer_dir, None, model="/models/Other-Model") as url:
        with pytest.raises(FetchError, match=r"serves \['/models/Other-Model'\], not the configured target"):
            fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / "o.jsonl")
        s = settings(tmp_path, url, tokenizer_dir, prompts)
        s["server"]["model"] = "typo"
        with pytest.raises(FetchError, match=r"server.model is 'typo' but .* serves \['/models/Other-Model'\]"):
            fetch.fetch(s, tmp_path / "o.jsonl")
    # the same model mounted elsewhere (same last path component) is accepted
    with fake(tokenizer_dir, None, "--sglang", model=f"/mnt/elsewhere/{tokenizer_dir.name}") as url:
        [rec, _] = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / "o.jsonl")
    assert (
        rec["server"]["model_path"] == f"/mnt/elsewhere/{tokenizer_dir.name}"
        and rec["server"]["weight_version"] == "w1"
    )


def test_multi_turn_conversation_feeds_each_answer_into_the_next_turn(tmp_path, tokenizer_dir, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(
        json.dumps({"id": "m", "system": "Be brief.", "turns": ["Question 0: first?", "And then?", "Last?"]})
        + "\n"
        + json.dumps({"id": "s", "messages": [{"role": "user", "content": "Question 1: single"}]})
        + "\n"
    )
    with fake(tokenizer_dir, None, "--sglang") as url:
        records = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / "o.jsonl")
    assert [(r["id"], r["prompt_id"], r["turn"]) for r in records] == [
        ("m#1", "m", 1),
        ("m#2", "m", 2),
        ("m#3", "m", 3),
        ("s", "s", 1),
    ]
    turns = records[:3]
    assert turns[2]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Question 0: first?"},
        {"role": "assistant", "content": turns[0]["text"]},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": turns[1]["text"]},
        {"role": "user", "content": "Last?"},
    ]
    eos = tok.eos_token_id
    for r in records:
        ids = tok(
            tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        assert r["prompt_token_ids"] == ids and r["token_check"]["prompt_tokens_match"] is True
        text, n, finish = fake_server.complete(ids, 16)  # the server's own function, by hand
        assert (r["text"], r["finish_reason"]) == (text, finish)
        assert r["completion_token_ids"] == tok.encode(text, add_special_tokens=False) + (
            [eos] if finish == "stop" else []
        )
        assert r["completion_ids_source"] == "server" and r["request"]["prompt_format"] == "token_ids"
        assert r["spec"] == fake_server.fake_spec_counters(n)  # asked for, read from sglext.spec_tokens_details
    # The bar's last state (log lines may follow it on stderr when an earlier test set up the CLI's logging).
    bar = [line for line in capsys.readouterr().err.splitlines() if "fetch t: " in line][-1].rstrip()
    assert re.search(r"fetch t: 100%.* 4/4 \[.*,\s+[\d.]+rec/s, [\d,]+ tok/s\]$", bar), bar  # request and token rates


def test_requests_run_with_the_heap_frozen_and_repeated_runs_leave_it_as_found(tmp_path, tokenizer_dir, monkeypatch):
    """The collector skips what was alive before the requests (full collections walked torch's ~290k objects,
    ~170 ms each, as long as the requests ran); afterwards the freeze is undone, run after run, and a heap
    frozen by the caller stays frozen."""
    # from an unfrozen heap (CPython 3.12 starts with 375 of its own objects frozen: tests/support/heap.py)
    gc.unfreeze()
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 4)
    request_one = fetch.request_one
    frozen_during: list[int] = []

    async def spy(*args, **kwargs):
        frozen_during.append(gc.get_freeze_count())
        return await request_one(*args, **kwargs)

    monkeypatch.setattr(fetch, "request_one", spy)
    with fake(tokenizer_dir) as url:
        for k in range(2):
            fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / f"o{k}.jsonl")
            assert heap.unfrozen()
        assert len(frozen_during) == 8 and min(frozen_during) > heap.interpreter_frozen_count()
        gc.freeze()
        try:
            fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), tmp_path / "o2.jsonl")
            assert gc.get_freeze_count() > 0
        finally:
            gc.unfreeze()


def test_prompts_rendered_together_are_tokenized_as_one_by_one(tokenizer_dir):
    """render_all tokenizes many texts in one call: no padding, no special tokens, each as alone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    conversations = [[{"role": "user", "content": "Q" * n}] for n in (1, 40, 3)] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "caf\u00e9?"}]
    ]
    alone = []
    for messages in conversations:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        alone.append((text, tok(text, add_special_tokens=False)["input_ids"]))
    assert fetch.render_all(tok, conversations, {}) == alone
    assert fetch.render_all(tok, [], {}) == []


def test_store_batches_appends_and_refuses_a_second_writer(tmp_path):
    out = tmp_path / "o.jsonl"
    with PartialStore(out, flush_s=3600, flush_records=3) as store:
        for i in range(2):
            store.add({"id": f"r{i}"})
        assert partial_path(out).read_text() == ""  # batched: nothing written yet
        store.add({"id": "r2"})
        assert len(read_records(partial_path(out))) == 3
        store.add({"id": "r3"})
        with pytest.raises(DflashEvalError, match="locked by another running fetch"):
            PartialStore(out).__enter__()
    assert [r["id"] for r in read_records(partial_path(out))] == ["r0", "r1", "r2", "r3"]  # flushed on exit
    partial_path(out).write_text('{"id": "r0"}\nnot json\n{"id": "r2"}\n')
    with pytest.raises(DflashEvalError, match=r"o.jsonl.partial:2: not a JSON record"):
        read_records(partial_path(out))


def test_finish_writes_added_and_kept_records_in_the_given_order(tmp_path):
    """finish() reuses the lines add() serialized, and serializes only the records add() never saw (kept ones)."""
    out = tmp_path / "o.jsonl"
    kept = {"id": "k", "text": "caf\u00e9 \u2603"}
    new = [{"id": f"r{i}", "completion_token_ids": [i, 7]} for i in range(2)]
    with PartialStore(out) as store:
        for rec in new:
            store.add(rec)
        store.finish([new[1], kept, new[0]])
    assert read_records(out) == [new[1], kept, new[0]]
    assert "caf\u00e9 \u2603" in out.read_text(encoding="utf-8")  # written as UTF-8 text, not escaped
    assert os.path.samefile(partial_path(out), out)  # kept, as a link of the output, for the next rerun


def test_a_failed_fsync_stops_finish_before_the_output_and_keeps_the_partial_file(tmp_path, monkeypatch):
    """The first fsync fails (a later one on the same descriptor may pass, as on Linux after EIO):
    finish raises before writing the output or dropping the partial file, which keeps the records."""
    import dflash_eval.fetch.store as fetch_store

    real_fsync, calls = fetch_store.os.fsync, []

    def failing_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(fetch_store.os, "fsync", failing_once)
    out = tmp_path / "o.jsonl"
    records = [{"id": f"r{i}"} for i in range(3)]
    with pytest.raises(DflashEvalError, match=r"o.jsonl.partial: fsync failed"):
        with PartialStore(out, flush_s=3600, flush_records=2) as store:
            for rec in records:
                store.add(rec)
            store.finish(records)
    assert not out.exists()
    assert [r["id"] for r in read_records(partial_path(out))] == ["r0", "r1", "r2"]


def test_backoff_doubles_with_jitter_and_is_capped():
    for attempt in range(4):
        delays = [backoff_delay(attempt, 0.5) for _ in range(200)]
        assert 0.25 * 2**attempt <= min(delays) and max(delays) <= 0.5 * 2**attempt
        assert len(set(delays)) > 100  # jittered
    assert backoff_delay(30, 0.5) <= 60.0
