"""Completions survive what Snakemake removes: the fetch stage against a real HTTP server process, the output
deleted between runs as Snakemake deletes it before it reruns the job."""

from __future__ import annotations

import json
import os

import pytest

from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.store import PartialStore, partial_path, pick_kept
from dflash_eval.testing import fixtures
from tests.support.fake_fetch import fake, served, settings


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    fixtures.build_tokenizer(out)
    return out


def test_a_rerun_after_the_output_was_removed_sends_only_new_or_changed_requests(tmp_path, tokenizer_dir):
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "o.jsonl"
    log = tmp_path / "requests.jsonl"
    with fake(tokenizer_dir, log) as url:
        first = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
        assert os.path.samefile(partial_path(out), out)
        out.unlink()  # Snakemake removes the output before it reruns fetch (here: a prompt was added)
        lines = prompts.read_text().splitlines(keepends=True)
        lines[1] = lines[1].replace("what is 1 + 1?", "what is 1 + 2?")  # one prompt edited
        prompts.write_text(
            "".join(lines)
            + json.dumps({"id": "p4", "messages": [{"role": "user", "content": "Question 4: what is 4 + 4?"}]})
            + "\n"
        )
        again = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
        assert sorted(served(log)) == [0, 1, 1, 2, 3, 4], "only the edited and the new prompt were sent again"
        assert [again[i] for i in (0, 2, 3)] == [first[i] for i in (0, 2, 3)]
        assert partial_path(out).stat().st_size == out.stat().st_size, "compacted to the output, not grown"

        out.unlink()  # a request setting changed: every record is fetched again, none reused by mistake
        changed = fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts, max_tokens=4), out)
        assert len(served(log)) == 11 and all(r["request"]["max_tokens"] == 4 for r in changed)


def test_a_run_by_hand_beside_a_finished_output_leaves_that_output_whole(tmp_path, tokenizer_dir):
    """The partial file is a link of the output: appending to it would change the output, so it is copied first."""
    prompts = fixtures.write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "o.jsonl"
    with fake(tokenizer_dir, None) as url:
        fetch.fetch(settings(tmp_path, url, tokenizer_dir, prompts), out)
    before = out.read_bytes()
    with PartialStore(out) as store:
        assert not os.path.samefile(partial_path(out), out)
        store.add({"id": "extra", "request": {}})
        store.flush()
    assert out.read_bytes() == before


def test_of_several_records_of_one_id_the_latest_made_with_this_request_is_kept():
    old, new, other = (
        {"id": "a", "request": {"m": 1}, "v": 1},
        {"id": "a", "request": {"m": 1}, "v": 2},
        {"id": "a", "request": {"m": 2}, "v": 3},
    )
    assert pick_kept([old, new, other], {"a"}, {"m": 1})["a"] is new
    assert pick_kept([old, other], {"a"}, {"m": 2})["a"] is other
    assert pick_kept([old, other], {"a"}, {"m": 3})["a"] is other  # none fits: the latest, refetched by its check
    assert pick_kept([old], {"b"}, {"m": 1}) == {}
