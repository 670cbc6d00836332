"""The packed multi-sample forward equals the per-sample block forward (blocks.py), block by block."""

import numpy as np
import pytest
import torch

from dflash_eval.evaluate import packed
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.packed import ContextPool, pack, packed_hidden
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("score_budget", [packed.SCORE_BUDGET, 1], ids=["one-pass", "slot-by-slot"])
@pytest.mark.parametrize("groups", ["slot", "row"])
@pytest.mark.parametrize("attention", ["products", "fused"])
def test_packed_blocks_equal_per_sample_blocks(dflash2, window, score_budget, groups, attention, monkeypatch):
    monkeypatch.setattr(packed, "SCORE_BUDGET", score_budget)
    monkeypatch.setattr(packed, "FUSED_MIN_QUERIES", 0)  # the tiny blocks' groups are small
    target = tiny_target()
    drafter = tiny_drafter([0, 2], window=window, block_size=6, dflash2=dflash2)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    generator = torch.Generator().manual_seed(0)
    lengths = [20, 31, 26, 17]
    features = [torch.randn(n, 128, generator=generator) for n in lengths]
    tokens = np.full((len(lengths), 40), -1, dtype=np.int64)
    for slot, n in enumerate(lengths):
        tokens[slot, :n] = torch.randint(2, 290, (n,), generator=generator).numpy()
    pool = ContextPool(runner, len(lengths), max(lengths), torch.device("cpu"), torch.float32)
    for slot, f in enumerate(features):
        pool.write(slot, runner, f)
    cos, sin = runner.rotary(40, pool.keys[0])
    # slots 0, 1 and 3 (not 2: the pool is gathered, not sliced), several blocks each, of sizes 2..6
    slot = np.array([0, 0, 0, 1, 1, 3, 3, 3, 3])
    anchor = np.array([3, 9, 15, 4, 25, 2, 8, 10, 14])
    size = np.array([6, 2, 5, 3, 6, 6, 4, 6, 2])
    with torch.no_grad():
        batch = pack(slot, anchor, size, tokens, MASK_ID, torch.device("cpu"), groups)
        assert not isinstance(batch.slots, slice)
        hidden = packed_hidden(runner, pool, batch, cos, sin, fused=attention == "fused")
        start = np.concatenate([[0], np.cumsum(size)[:-1]])
        for row in range(len(slot)):
            s, a, b = int(slot[row]), int(anchor[row]), int(size[row])
            context = runner.context(features[s])
            alone = runner.block_hidden(context, torch.from_numpy(tokens[s, : lengths[s]]), torch.tensor([a]), b)[0]
            torch.testing.assert_close(hidden[start[row] : start[row] + b], alone, atol=2e-5, rtol=1e-5)


def _groups(ctx: list[int], queries: list[int]):
    from types import SimpleNamespace

    return SimpleNamespace(group_ctx=np.array(ctx), group_queries=np.array(queries), ctx_len=max(ctx))


def test_the_attention_runs_in_one_pass_unless_a_split_removes_a_quarter_of_the_scores(monkeypatch):
    monkeypatch.setattr(packed, "SCORE_BUDGET", 1 << 40)
    alike = packed._parts(_groups([1000, 990, 980, 1000, 995, 1000, 985, 1000], [16] * 8), heads=4)
    assert [(p.groups, p.see, p.width) for p in alike] == [(slice(0, 8), 1000, 16)]
    # longest first, as the pool holds them: the short half needs a tenth of the context and a quarter of the
    # queries, so two parts halve the scores; four would remove nothing more and cost launches
    apart = packed._parts(_groups([1000] * 4 + [100] * 4, [16] * 4 + [4] * 4), heads=4)
    assert [(p.groups, p.see, p.width) for p in apart] == [(slice(0, 4), 1000, 16), (slice(4, 8), 100, 4)]


def test_the_score_budget_bounds_every_part(monkeypatch):
    monkeypatch.setattr(packed, "SCORE_BUDGET", 3 * 4 * 16 * (1000 + 16))  # three groups' scores
    parts = packed._parts(_groups([1000] * 8, [16] * 8), heads=4)
    assert [p.groups for p in parts] == [slice(0, 3), slice(3, 6), slice(6, 8)]


@pytest.mark.parametrize("threshold, runs", [(0, True), (7, True), (8, False)])
def test_the_fused_kernel_runs_only_where_a_group_holds_enough_queries(threshold, runs, monkeypatch):
    """The widest group here holds 7 queries (two blocks of one sample): fused at a threshold of 7, not of 8;
    never where the caller does not allow it; and a CPU never allows it."""
    monkeypatch.setattr(packed, "FUSED_MIN_QUERIES", threshold)
    target = tiny_target()
    drafter = tiny_drafter([0, 2], block_size=6)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    features = torch.randn(2, 20, 128, generator=torch.Generator().manual_seed(1))
    tokens = np.full((2, 30), 5, dtype=np.int64)
    pool = ContextPool(runner, 2, 20, torch.device("cpu"), torch.float32)
    for slot in range(2):
        pool.write(slot, runner, features[slot])
    cos, sin = runner.rotary(30, pool.keys[0])
    calls = []
    inner = packed.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(packed.F, "scaled_dot_product_attention", counted)
    batch = pack(np.array([0, 0, 1]), np.array([4, 9, 6]), np.array([3, 4, 2]), tokens, MASK_ID, torch.device("cpu"))
    with torch.no_grad():
        packed_hidden(runner, pool, batch, cos, sin, fused=False)
        assert not calls
        packed_hidden(runner, pool, batch, cos, sin, fused=True)
    assert bool(calls) == runs
    assert packed.fused_attention_for(torch.device("cpu")) is False
    assert packed.fused_attention_for(torch.device("cuda")) is True
