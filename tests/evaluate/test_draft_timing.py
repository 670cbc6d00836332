"""T_draft: the drafter step timed as the evaluator runs it, on a tiny drafter; not timed where measure says not."""

from types import SimpleNamespace

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


def test_not_timed_on_a_cpu_with_measure_auto_or_false():
    cache = SimpleNamespace(samples=[{"id": "0", "length": 20}])
    for measure in ("auto", False):
        assert time_on_cache(None, cache, LAYERS, torch.device("cpu"), torch.float32, {"measure": measure}) is None
