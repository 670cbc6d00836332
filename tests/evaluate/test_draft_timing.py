"""T_draft: the drafter step timed as the evaluator runs it, on a tiny drafter; not timed where measure says not."""

from types import SimpleNamespace

import pytest
import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.draft_timing import drafter_step_ms, time_on_cache
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

LAYERS = [0, 2]


def _runner():
    target = tiny_target(seed=0)
    drafter = tiny_drafter(LAYERS, block_size=4).eval()
    return BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)


def test_drafter_step_is_timed_at_the_context_the_sample_allows():
    runner = _runner()
    tokens = torch.randint(2, 290, (20,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(20, 64 * len(LAYERS), generator=torch.Generator().manual_seed(1))
    timing = drafter_step_ms(runner, features, tokens, context_tokens=2048, repeats=3)
    assert timing["context_tokens"] == 19 and timing["device"] == "cpu"   # the longest context the sample has
    assert 0 < timing["min_ms"] <= timing["ms"] <= timing["max_ms"]
    assert drafter_step_ms(runner, features, tokens, context_tokens=8, repeats=1)["context_tokens"] == 8
    assert timing["block_size"] == 4 and timing["project_tokens"] == 1


def test_each_block_size_is_its_own_step_with_its_context_projection(monkeypatch):
    """The step at block b runs a block of b and projects the asked rows: counted on the runner's own calls."""
    runner = _runner()
    tokens = torch.randint(2, 290, (20,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(20, 64 * len(LAYERS), generator=torch.Generator().manual_seed(1))
    seen = {"context_rows": [], "blocks": []}
    context, block_hidden = runner.context, runner.block_hidden
    monkeypatch.setattr(runner, "context", lambda f: seen["context_rows"].append(f.shape[0]) or context(f))
    monkeypatch.setattr(runner, "block_hidden", lambda *a, **k: seen["blocks"].append(a[3]) or block_hidden(*a, **k))
    timing = drafter_step_ms(runner, features, tokens, context_tokens=12, repeats=2, block_size=3, project_tokens=5)
    assert timing["block_size"] == 3 and timing["project_tokens"] == 5
    assert seen["context_rows"][0] == 13 and set(seen["context_rows"][1:]) == {5}  # all 13 once, then 5 per step
    assert set(seen["blocks"]) == {3}
    with pytest.raises(ValueError, match="blocks of 2..4"):
        drafter_step_ms(runner, features, tokens, context_tokens=12, repeats=1, block_size=8)


def test_time_on_cache_times_every_block_asked():
    runner = _runner()
    tokens = torch.randint(2, 290, (20,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(20, 64 * len(LAYERS), generator=torch.Generator().manual_seed(1))
    cache = SimpleNamespace(samples=[{"id": "0", "length": 20}],
                            load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens))
    options = {"measure": True, "context_tokens": 12, "repeats": 1}
    timing = time_on_cache(runner, cache, LAYERS, torch.device("cpu"), torch.float32, options, {2: 1, 4: 3, 9: 1})
    assert sorted(timing["by_block"]) == [2, 4]  # 9 is beyond the drafter's block: not a step it drafts
    assert timing["by_block"][4]["project_tokens"] == 3 and timing["context_tokens"] == 12


def test_not_timed_on_a_cpu_with_measure_auto_or_false():
    cache = SimpleNamespace(samples=[{"id": "0", "length": 20}])
    for measure in ("auto", False):
        assert time_on_cache(None, cache, LAYERS, torch.device("cpu"), torch.float32, {"measure": measure},
                             {4: 1}) is None
