"""The demo server's SGLANG_SIMULATE_ACC_LEN and meta_info timing, against SGLang 0.5.23's semantics: the
switches' defaults read from the wheel, hand-computed step counts for forced lengths, and fetch's engine
records from it end to end."""

from __future__ import annotations

import ast
import math

import pytest

from dflash_eval.demo.server import FIXED_TOKEN_ID, fixed_tokens, simulation_from_env
from dflash_eval.fetch import stage as fetch
from dflash_eval.server.control import ServerController
from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.demo_server import BLOCK, demo_server, tiny_drafter_dir

MAX_TOKENS = 12


def test_the_switches_defaults_are_0_5_23s(sglang_srt):
    """environ.py: LEN EnvFloat(-1) (off), METHOD EnvStr("match-expected"), TOKEN_MODE EnvStr("fixed"); the fixed
    mode's token is apply_dflash_simulated_acceptance's fixed_token_id default (dflash_utils.py)."""
    tree = ast.parse((sglang_srt / "environ.py").read_text(encoding="utf-8"))
    defaults = {
        node.targets[0].id: ast.unparse(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.startswith("SGLANG_SIMULATE_ACC_")
    }
    assert defaults["SGLANG_SIMULATE_ACC_LEN"] == "EnvFloat(-1)"
    assert defaults["SGLANG_SIMULATE_ACC_METHOD"] == "EnvStr('match-expected')"
    assert defaults["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == "EnvStr('fixed')"
    utils = ast.parse((sglang_srt / "speculative/dflash_utils.py").read_text(encoding="utf-8"))
    apply = next(
        n for n in utils.body if isinstance(n, ast.FunctionDef) and n.name == "apply_dflash_simulated_acceptance"
    )
    names = [a.arg for a in apply.args.kwonlyargs]
    assert ast.literal_eval(apply.args.kw_defaults[names.index("fixed_token_id")]) == FIXED_TOKEN_ID
    # the worker applies it whenever the length is > 0 (dflash_worker_v2.py, _accept_block)
    assert "if SIMULATE_ACC_LEN > 0:" in (sglang_srt / "speculative/dflash_worker_v2.py").read_text(encoding="utf-8")


def test_the_switches_parsed_as_sglang_reads_them():
    assert simulation_from_env({}) is None
    assert simulation_from_env({"SGLANG_SIMULATE_ACC_LEN": "-1"}) is None  # the default: off
    assert simulation_from_env({"SGLANG_SIMULATE_ACC_LEN": "0"}) is None  # the worker wants > 0
    assert simulation_from_env({"SGLANG_SIMULATE_ACC_LEN": "3.5"}) == {"length": 3.5, "token_mode": "fixed"}
    assert simulation_from_env(
        {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}
    ) == {"length": 2.0, "token_mode": "real-draft-token"}
    for env, named in (
        ({"SGLANG_SIMULATE_ACC_LEN": "three"}, "SGLANG_SIMULATE_ACC_LEN='three'"),
        ({"SGLANG_SIMULATE_ACC_LEN": "3", "SGLANG_SIMULATE_ACC_METHOD": "multinomial"}, "multinomial"),
        ({"SGLANG_SIMULATE_ACC_LEN": "3", "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real"}, "'real'"),
    ):
        with pytest.raises(SystemExit, match=named):
            simulation_from_env(env)


def test_the_fixed_mode_writes_its_token_after_the_prefills_by_hand():
    assert fixed_tokens([7, 8, 9, 2], stops=[2], max_tokens=4) == [7, 100, 100, 100]  # the real stop is not seen
    assert fixed_tokens([7, 8, 9, 5, 6], stops=[2], max_tokens=3) == [7, 100, 100]
    assert fixed_tokens([7, 8, 9], stops=[100], max_tokens=3) == [7, 100]  # id 100 a stop token: finished there


def steps_for(length: int, max_tokens: int, block: int) -> int:
    """Hand count: the prefill gives 1 token, each step commits min(length, block); SGLang stops at max_tokens."""
    return math.ceil((max_tokens - 1) / min(length, block))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("simulate")
    target = hs.build_tiny_target(base / "target")
    return target, tiny_drafter_dir(target, base / "drafter")


def engine(models, monkeypatch, env: dict[str, str], metrics: bool = True):
    """The demo server's engine in this process (what its HTTP handler calls), under `env`."""
    import argparse

    from dflash_eval.demo.server import Engine, add_arguments

    for name in ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_SIMULATE_ACC_METHOD", "SGLANG_SIMULATE_ACC_TOKEN_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model-path",
            str(models[0]),
            "--speculative-algorithm",
            "DFLASH",
            "--speculative-draft-model-path",
            str(models[1]),
            "--speculative-num-draft-tokens",
            str(BLOCK),
        ]
        + (["--enable-metrics"] if metrics else [])
    )
    return Engine(args)


@pytest.mark.parametrize(
    ("length", "mode", "steps"), [(3, "fixed", 4), (10, "real-draft-token", 3), (2.5, "real-draft-token", None)]
)
def test_forced_lengths_in_the_engine_by_hand(models, monkeypatch, length, mode, steps):
    """12 tokens: the prefill's, then k a step: k 3 -> 4 steps (1 + 12 cut to 12); 10 is clamped to the block, 4
    -> 3 steps; 2.5 commits 2 or 3 a step (match-expected: its floor or ceiling)."""
    import time

    from dflash_eval.extract.backends import use_backend

    with use_backend("torch", "cpu"):
        server = engine(
            models, monkeypatch, {"SGLANG_SIMULATE_ACC_LEN": str(length), "SGLANG_SIMULATE_ACC_TOKEN_MODE": mode}
        )
        for prompt in ([5, 6, 7, 8], [9, 10, 11]):
            received = time.perf_counter()
            ids, spec, timing = server.timed_generate(prompt, MAX_TOKENS, None, received)
            if mode == "fixed":
                assert ids[1:] == [FIXED_TOKEN_ID] * (MAX_TOKENS - 1)
            histogram = spec["spec_correct_drafts_histogram"]
            if steps is not None:
                if len(ids) == MAX_TOKENS:
                    assert steps == steps_for(length, MAX_TOKENS, BLOCK)
                else:  # real drafts met the stop token first: that step counted whole, as SGLang counts it
                    assert ids[-1] in server.stops
                    steps = steps_for(length, len(ids), BLOCK)
                k = min(length, BLOCK)
                assert spec["spec_verify_ct"] == steps and histogram == [0] * (k - 1) + [steps]
                assert spec["spec_num_correct_drafts"] == steps * (k - 1)  # counted raw, the cut step whole
            elif steps is None:
                assert set(i for i, n in enumerate(histogram) if n) <= {1, 2}  # 2 or 3 committed: 1 or 2 drafts
            assert 0 <= timing["queue_time"] < timing["first_token_latency"] < timing["e2e_latency"]
            assert timing["decode_throughput"] == pytest.approx(
                (len(ids) - 1) / (timing["e2e_latency"] - timing["first_token_latency"]), rel=1e-6
            )
    with use_backend("torch", "cpu"):
        plain = engine(models, monkeypatch, {}, metrics=False)
        _, _, timing = plain.timed_generate([5, 6, 7], 4, None, time.perf_counter())
    assert set(timing) == {"e2e_latency"}  # without --enable-metrics, as 0.5.23


@pytest.mark.slow
def test_fetch_records_the_forced_counters_and_the_engines_timing(tmp_path):
    """Over HTTP, through fetch: length 3, fixed tokens, commits 3 a step: 4 steps for 12 tokens; each record's
    `engine` holds meta_info's timing (--enable-metrics) beside spec_verify_ct and the completion's tokens."""
    length, mode = 3, "fixed"
    settings, target, _ = demo_server(
        tmp_path, f"SGLANG_SIMULATE_ACC_LEN={length} SGLANG_SIMULATE_ACC_TOKEN_MODE={mode}", "--enable-metrics"
    )
    controller = ServerController(settings)
    controller.ensure_up()
    try:
        records = fetch.fetch(
            {
                "dataset": "t",
                "prompts": str(fixtures.write_prompts(tmp_path / "p.jsonl", 2)),
                "server": settings,
                "tokenizer": str(target),
                "max_tokens": MAX_TOKENS,
                "endpoint": "chat",
                "concurrency": 1,
                "chat_template_kwargs": {},
            },
            tmp_path / "c.jsonl",
        )
    finally:
        controller.stop_if_launched()
    steps, k = steps_for(length, MAX_TOKENS, BLOCK), min(length, BLOCK)
    for record in records:
        ids = record["completion_token_ids"]
        assert ids[1:] == [FIXED_TOKEN_ID] * (MAX_TOKENS - 1)  # no stop token can end it
        assert record["spec"]["spec_verify_ct"] == steps
        assert record["spec"]["spec_correct_drafts_histogram"] == [0] * (k - 1) + [steps]
        assert record["spec"]["spec_num_correct_drafts"] == steps * (k - 1)  # counted raw, the cut step whole
        engine = record["engine"]
        assert engine["meta_info"] is True and engine["spec_verify_ct"] == record["spec"]["spec_verify_ct"]
        assert engine["completion_tokens"] == len(ids)
        assert 0 <= engine["queue_time"] < engine["first_token_latency"] < engine["e2e_latency"]
        assert engine["decode_throughput"] == pytest.approx(
            (len(ids) - 1) / (engine["e2e_latency"] - engine["first_token_latency"]), rel=1e-6
        )
        assert record["client_timing"]["wall_s"] >= engine["e2e_latency"]  # ours includes the transport
