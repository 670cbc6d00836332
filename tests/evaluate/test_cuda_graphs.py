"""The CUDA graphs' padded forward (cuda_graphs.py) gives the eager forward's real outputs and steps.

On the CPU the graph is the eager stand-in (eager_capture): what a replay adds besides the replay itself (the
padding to fixed shapes, the copies into the captured inputs, the slicing) is all tested here; the replay on CUDA
is the gpu-marked test."""

import numpy as np
import pytest
import torch

from dflash_eval.evaluate import packed
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.cuda_graphs import (
    ROUTES,
    GraphedForward,
    eager_capture,
    graph_options,
    queries_bucket,
)
from dflash_eval.evaluate.packed import (
    ContextPool,
    Padding,
    pack,
    pack_arrays,
    packed_hidden,
)
from dflash_eval.evaluate.trajectory import EvaluatorOptions, TrajectoryEvaluator
from tests.support import trajectory_cases as cases
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target
from tests.support.trajectory_cases import BLOCK, BUDGETS, STOPS, TOPK

SLOT = np.array([0, 0, 0, 1, 1, 3, 3, 3, 3])
ANCHOR = np.array([3, 9, 15, 4, 25, 2, 8, 10, 14])
SIZE = np.array([6, 2, 5, 3, 6, 6, 4, 6, 2])


def _pool(window, device="cpu"):
    target = tiny_target()
    drafter = tiny_drafter([0, 2], window=window, block_size=6)
    runner = BlockDrafter(
        drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID
    ).to(device)
    generator = torch.Generator().manual_seed(0)
    lengths = [20, 31, 26, 17]
    tokens = np.full((len(lengths), 40), -1, dtype=np.int64)
    pool = ContextPool(runner, len(lengths), max(lengths), torch.device(device), torch.float32)
    for slot, n in enumerate(lengths):
        tokens[slot, :n] = torch.randint(2, 290, (n,), generator=generator).numpy()
        pool.write(slot, runner, torch.randn(n, 128, generator=generator).to(device))
    cos, sin = runner.rotary(40, pool.keys[0])
    return runner, pool, tokens, cos, sin


def test_the_padding_adds_only_hidden_tokens_groups_and_keys():
    arrays, facts = pack_arrays(
        SLOT,
        ANCHOR,
        SIZE,
        np.zeros((4, 40), dtype=np.int64),
        MASK_ID,
        padding=Padding(tokens=64, queries=32, slots=4, context=31),
    )
    n = int(SIZE.sum())
    assert arrays["token_ids"].shape == arrays["positions"].shape == arrays["padded_index"].shape == (64,)
    assert (arrays["token_ids"][n:] == MASK_ID).all() and (arrays["positions"][n:] == 0).all()
    assert arrays["query_row"].shape == (4, 32)
    assert (arrays["query_row"][2] == -1).all() and (arrays["query_anchor"][2] == 0).all()  # slot 2: no block
    real = arrays["query_row"] >= 0
    assert sorted(arrays["query_gather"][real].tolist()) == list(range(n))  # padded tokens are never gathered
    assert facts["ctx_len"] == 31 and (facts["group_queries"] == 32).all()
    with pytest.raises(ValueError, match="more than the padding"):
        pack_arrays(
            SLOT,
            ANCHOR,
            SIZE,
            np.zeros((4, 40), dtype=np.int64),
            MASK_ID,
            padding=Padding(tokens=64, queries=8, slots=4, context=31),
        )


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("fused", [False, True], ids=["products", "fused"])
def test_the_padded_forward_equals_the_eager_one(window, fused, monkeypatch):
    monkeypatch.setattr(packed, "FUSED_MIN_QUERIES", 0 if fused else packed.FUSED_MIN_QUERIES)
    runner, pool, tokens, cos, sin = _pool(window)
    graphed = GraphedForward(runner, pool, cos, sin, [16, 48, 64], eager_capture)
    with torch.no_grad():
        eager = packed_hidden(
            runner, pool, pack(SLOT, ANCHOR, SIZE, tokens, MASK_ID, torch.device("cpu")), cos, sin, fused
        )
        hidden = graphed(SLOT, ANCHOR, SIZE, tokens, fused)
        torch.testing.assert_close(hidden, eager, atol=2e-5, rtol=1e-5)
        assert list(graphed.graphs) == [(48, queries_bucket(18), fused)]  # 40 tokens; slot 3 holds 18 queries
        again = graphed(SLOT[:3], ANCHOR[:3], SIZE[:3], tokens, fused)  # the same captured inputs, overwritten
        torch.testing.assert_close(
            again,
            packed_hidden(
                runner,
                pool,
                pack(SLOT[:3], ANCHOR[:3], SIZE[:3], tokens, MASK_ID, torch.device("cpu")),
                cos,
                sin,
                fused,
            ),
            atol=2e-5,
            rtol=1e-5,
        )
        assert graphed(np.repeat(SLOT, 2), np.repeat(ANCHOR, 2), np.repeat(SIZE, 2), tokens, fused) is None  # 80 > 64


@pytest.mark.parametrize("sizes", [[8, 32], [4096]], ids=["late-rounds-only", "every-round"])
def test_the_evaluator_with_graphs_takes_todays_steps(sizes):
    runner = cases.runner()
    sequences = cases.sequences(runner)
    options = dict(blocks_per_forward=128, pool_slots=4, head_split=2)  # EvaluatorOptions' fields
    today = TrajectoryEvaluator(runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(**options))
    expected = dict(today.run(cases.specs(sequences)))
    evaluator = TrajectoryEvaluator(
        runner,
        STOPS,
        range(2, BLOCK + 1),
        BUDGETS,
        TOPK,
        EvaluatorOptions(cuda_graph_tokens=sizes, graph_capture=eager_capture, **options),
    )
    results = dict(evaluator.run(cases.specs(sequences)))
    for key in expected:
        assert results[key].steps == expected[key].steps, key
        assert np.array_equal(results[key].topk_hits, expected[key].topk_hits), key
    assert 0 < evaluator.counts.graph_replays <= evaluator.counts.forwards == today.counts.forwards
    if sizes == [4096]:
        assert evaluator.counts.graph_replays == evaluator.counts.forwards
    else:
        assert evaluator.counts.graph_replays < evaluator.counts.forwards


def test_exact_token_graphs_take_todays_steps_one_graph_per_token_count_up_to_the_cap():
    """exact_tokens: every captured forward has the eager forward's own flat token count (its GEMMs' rows); past
    max_graphs distinct shapes a round runs eagerly; the steps stay today's."""
    runner = cases.runner()
    sequences = cases.sequences(runner)
    options = dict(blocks_per_forward=128, pool_slots=4, head_split=2)  # EvaluatorOptions' fields
    today = TrajectoryEvaluator(runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(**options))
    expected = dict(today.run(cases.specs(sequences)))
    seen = []

    def capture(forward):
        seen.append(None)
        return forward

    for cap in (None, 2):
        evaluator = TrajectoryEvaluator(
            runner,
            STOPS,
            range(2, BLOCK + 1),
            BUDGETS,
            TOPK,
            EvaluatorOptions(
                cuda_graph_tokens=[4096], graph_capture=capture, graph_exact_tokens=True, max_graphs=cap, **options
            ),
        )
        results = dict(evaluator.run(cases.specs(sequences)))
        for key in expected:
            assert results[key].steps == expected[key].steps, key
        tokens = {padding_tokens for padding_tokens, _, _ in evaluator.graphed.graphs}
        assert all(t < 4096 for t in tokens)  # no padding to the size class
        if cap is None:
            assert evaluator.counts.graph_replays == evaluator.counts.forwards and len(evaluator.graphed.graphs) > 2
        else:
            assert len(evaluator.graphed.graphs) == 2 < len(seen) - 2
            assert 0 < evaluator.counts.graph_replays < evaluator.counts.forwards


def test_an_exact_token_padding_keeps_the_round_s_tokens():
    runner, pool, tokens, cos, sin = _pool(None)
    graphed = GraphedForward(runner, pool, cos, sin, [64], eager_capture, exact_tokens=True)
    assert graphed.padding(SIZE, SLOT).tokens == int(SIZE.sum())
    assert graphed.padding(np.repeat(SIZE, 2), np.repeat(SLOT, 2)) is None  # 80 > 64


def test_the_config_key_picks_a_route_on_cuda_only_and_every_route_is_a_valid_evaluator():
    runner = cases.runner()
    cuda = torch.device("cuda")
    assert graph_options("round_tokens", torch.device("cpu"), runner) == {}  # a CPU evaluation stays eager
    assert graph_options("none", cuda, runner) == {}
    assert graph_options("padded", cuda, runner) == ROUTES["padded"]
    assert graph_options("round_tokens", cuda, cases.runner(dflash2=True)) == {}  # shapes vary per round: eager
    with pytest.raises(ValueError, match="evaluation.cuda_graphs: 'on'"):
        graph_options("on", cuda, runner)
    for route in ROUTES:
        TrajectoryEvaluator(runner, STOPS, options=EvaluatorOptions(graph_capture=eager_capture, **ROUTES[route]))


def test_the_schema_defines_the_key_once_default_none():
    from dflash_eval import config as cfg

    schema = cfg.stage_schema("evaluate")["properties"]["cuda_graphs"]
    assert schema["default"] == "none" and set(schema["enum"]) == set(ROUTES)


def test_graphs_are_refused_where_shapes_vary():
    with pytest.raises(ValueError, match="cuda_graph_tokens"):
        TrajectoryEvaluator(cases.runner(dflash2=True), STOPS, options=EvaluatorOptions(cuda_graph_tokens=[64]))
    with pytest.raises(ValueError, match="cuda_graph_tokens"):
        TrajectoryEvaluator(
            cases.runner(), STOPS, options=EvaluatorOptions(cuda_graph_tokens=[64], attention_groups="row")
        )


@pytest.mark.gpu
def test_the_graph_replay_takes_the_eager_steps_on_cuda():
    """fp32 on CUDA: real graphs at every round size take the eager evaluator's steps (the exactness rule)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runner = cases.runner().to("cuda")
    sequences = [(key, f.cuda(), t.cuda(), lim) for key, f, t, lim in cases.sequences(cases.runner())]
    options = dict(blocks_per_forward=128, pool_slots=4, head_split=2)  # EvaluatorOptions' fields
    expected = dict(
        TrajectoryEvaluator(runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(**options)).run(
            cases.specs(sequences)
        )
    )
    evaluator = TrajectoryEvaluator(
        runner, STOPS, range(2, BLOCK + 1), BUDGETS, TOPK, EvaluatorOptions(cuda_graph_tokens=[32, 4096], **options)
    )
    results = dict(evaluator.run(cases.specs(sequences)))
    for key in expected:
        assert results[key].steps == expected[key].steps, key
    assert evaluator.counts.graph_replays == evaluator.counts.forwards and evaluator.counts.graphs > 0
