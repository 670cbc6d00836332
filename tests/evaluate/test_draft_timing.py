"""T_draft: the drafter step timed as the evaluator runs it, on a tiny drafter; not timed where measure says not."""

import tempfile
from types import SimpleNamespace

import pytest
import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.draft_timing import (
    TreeWork,
    _eager_step,
    drafter_step_ms,
    static_step,
    time_on_cache,
    timing_method,
)
from dflash_eval.evaluate.drafter import load_drafter
from dflash_eval.speedup.forwards.tree_step import ancestors, build_tree, tree_views
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

LAYERS = [0, 2]


def _runner(dflash2: bool = False, **settings):
    """The drafter as evaluation loads it (evaluate/drafter.py: the evaluator's own class, no forward and no
    compute_logits), from a saved checkpoint: a GPU demo once failed on a path these tests ran on dflash's class.
    `settings` go into its dflash_config (input_embedding_scale, output_multiplier, final_logit_softcapping)."""
    target = tiny_target(seed=0)
    with tempfile.TemporaryDirectory() as root:
        drafter = tiny_drafter(LAYERS, block_size=4, dflash2=dflash2)
        drafter.config.dflash_config.update(settings)
        drafter.save_pretrained(root, safe_serialization=True)
        drafter = load_drafter(root).model.eval()
    assert not hasattr(drafter, "compute_logits")
    return BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)


def test_drafter_step_is_timed_at_the_context_the_sample_allows():
    runner = _runner()
    tokens = torch.randint(2, 290, (20,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(20, 64 * len(LAYERS), generator=torch.Generator().manual_seed(1))
    timing = drafter_step_ms(runner, features, tokens, context_tokens=2048, repeats=3)
    assert timing["context_tokens"] == 19 and timing["device"] == "cpu"  # the longest context the sample has
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
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    options = {"measure": True, "context_tokens": 12, "repeats": 1}
    timing = time_on_cache(runner, cache, LAYERS, torch.device("cpu"), torch.float32, options, {2: 1, 4: 3, 9: 1})
    assert sorted(timing["by_block"]) == [2, 4]  # 9 is beyond the drafter's block: not a step it drafts
    assert timing["by_block"][4]["project_tokens"] == 3 and timing["context_tokens"] == 12


def test_not_timed_on_a_cpu_with_measure_auto_or_false():
    cache = SimpleNamespace(samples=[{"id": "0", "length": 20}])
    for measure in ("auto", False):
        assert (
            time_on_cache(None, cache, LAYERS, torch.device("cpu"), torch.float32, {"measure": measure}, {4: 1}) is None
        )


def _sample():
    tokens = torch.randint(2, 290, (20,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(20, 64 * len(LAYERS), generator=torch.Generator().manual_seed(1))
    return features, tokens


SCALED = {"input_embedding_scale": 1.7, "output_multiplier": 0.5, "final_logit_softcapping": 0.3}


@pytest.mark.parametrize(
    ("anchor", "block", "project", "settings"),
    [(12, 4, 1, {}), (12, 3, 5, {}), (19, 2, 2, {}), (3, 4, 4, {}), (12, 4, 2, SCALED)],
)
def test_the_static_step_drafts_what_the_evaluators_step_drafts(anchor, block, project, settings):
    """The graphs' step (the validated loop's static drafter) does the evaluator's work: the same drafts at the
    same anchor, block and projection, in fp32 on the CPU (its code path, run eagerly); with the embedding scale,
    output multiplier and softcap a checkpoint may set, the same logits too."""
    runner = _runner(**settings)
    features, tokens = _sample()
    with torch.inference_mode():
        context = runner.context(features[: anchor + 1])
        hidden = runner.block_hidden(context, tokens[: anchor + 1], torch.tensor([anchor]), block, ctx_len=anchor)
        expected = runner.logits(hidden).argmax(-1)[0]
    step, drafts = static_step(runner, features, tokens, anchor, block, project, graphs=True)  # no graphs on a CPU
    step()
    assert torch.equal(drafts(), expected)
    if settings:  # the logits themselves, through a DDTree step's top-k (a softcap of 0.3 leaves argmax ties rare)
        tree = TreeWork(8, block - 1, runner.lm_head.shape[0], torch.device("cpu"))
        with torch.inference_mode():
            static_step(runner, features, tokens, anchor, block, project, graphs=True, tree=tree)[0]()
            logits = runner.logits(hidden)[0].float()
        reference = torch.log_softmax(logits, -1).topk(8, -1)
        assert torch.allclose(tree.top[0], reference.values.double(), atol=1e-5)
        assert runner.softcap == 0.3 and logits.abs().max() <= 0.3  # the settings reached the evaluator


@pytest.mark.parametrize("budget", [3, 10, 400])  # 400: beyond the tiny vocab (the top-k takes all of it)
def test_a_ddtree_step_builds_the_tree_ddtree_would_from_the_evaluators_logits(budget):
    """The DDTree drafting step, static and eager, ends with the tree the evaluator's own logits give: built
    here by hand from a plain log-softmax top-k of runner.logits (the reference), and compared node for node."""
    runner = _runner()
    features, tokens = _sample()
    anchor, block, project = 12, 4, 2
    with torch.inference_mode():
        context = runner.context(features[: anchor + 1])
        hidden = runner.block_hidden(context, tokens[: anchor + 1], torch.tensor([anchor]), block, ctx_len=anchor)
        top = torch.log_softmax(runner.logits(hidden)[0].float(), -1).topk(min(budget, runner.lm_head.shape[0]), -1)
    parents, depths, node_tokens = build_tree(top.values.numpy(), top.indices.numpy(), budget)
    assert len(parents) == budget + 1  # the tiny vocab (and 3 positions) hold every budget asked
    for make in (
        lambda tree: static_step(runner, features, tokens, anchor, block, project, graphs=True, tree=tree)[0],
        lambda tree: _eager_step(runner, features, tokens, anchor, block, project, tree),
    ):
        tree = TreeWork(budget, block - 1, runner.lm_head.shape[0], torch.device("cpu"))
        with torch.inference_mode():  # as drafter_step_ms runs it
            tree.after(make(tree))()
        ids, depth, mask = tree_views(tree.tree, budget)
        assert ids[0, 1:].tolist() == node_tokens[1:] and depth.tolist() == depths
        assert torch.equal(mask, torch.from_numpy(ancestors(parents)))


def test_a_ddtree_step_is_timed_per_budget_at_the_drafters_own_block():
    runner = _runner()
    features, tokens = _sample()
    timing = drafter_step_ms(runner, features, tokens, 12, repeats=2, budget=16, project_tokens=3, method="static")
    assert timing["budget"] == 16 and timing["block_size"] == 4 and timing["ms"] > 0
    with pytest.raises(ValueError, match="drafter's own block"):
        drafter_step_ms(runner, features, tokens, 12, repeats=1, block_size=3, budget=16)
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    timing = time_on_cache(
        runner,
        cache,
        LAYERS,
        torch.device("cpu"),
        torch.float32,
        {"measure": True, "context_tokens": 12, "repeats": 1},
        {4: 3},
        None,
        {16: 2, 64: 5},
    )
    assert sorted(timing["by_budget"]) == [16, 64] and sorted(timing["by_block"]) == [4]
    assert timing["by_budget"][64]["project_tokens"] == 5 and timing["by_budget"][64]["budget"] == 64


def test_a_dflash2_drafters_steps_are_timed_eagerly_trees_included():
    """DFlash2's block convolutions and selector are the evaluator's alone: its steps, a DDTree's too, run eagerly
    on CUDA as on a CPU (the method is chosen for CUDA here; the timing itself runs on the CPU)."""
    runner = _runner(dflash2=True)
    assert timing_method(runner, torch.device("cuda"), "graphs")[0] == "eager"
    features, tokens = _sample()
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    timing = time_on_cache(
        runner,
        cache,
        LAYERS,
        torch.device("cpu"),
        torch.float32,
        {"measure": True, "context_tokens": 12, "repeats": 1},
        {4: 2},
        "graphs",
        {16: 2},
    )
    assert timing["by_budget"][16]["ms"] > 0 and timing["by_budget"][16]["method"] == "eager"


def test_the_method_follows_the_target_profile_and_the_device():
    runner = _runner()
    assert timing_method(runner, torch.device("cpu"), "graphs") == ("eager", "no CUDA graphs on this device")
    cuda = torch.device("cuda")
    assert timing_method(runner, cuda, "graphs")[0] == "graphs" and timing_method(runner, cuda, None)[0] == "graphs"
    method, why = timing_method(runner, cuda, "eager")
    assert method == "eager" and "timed eagerly" in why
    dflash2 = SimpleNamespace(
        drafter=SimpleNamespace(candidate_selector=object(), layers=[], mask_token_id=5), mask_token_id=5
    )
    assert "DFlash2" in timing_method(dflash2, cuda, "graphs")[1]
    other_mask = SimpleNamespace(drafter=SimpleNamespace(layers=[], mask_token_id=None), mask_token_id=5)
    assert timing_method(other_mask, cuda, "graphs") == (
        "eager",
        "the drafter's config names mask token None and evaluation uses 5: the static drafter reads the config's",
    )


def test_each_method_is_timed_and_recorded():
    runner = _runner()
    features, tokens = _sample()
    for method in ("static", "eager"):
        timing = drafter_step_ms(
            runner, features, tokens, 12, repeats=2, block_size=3, project_tokens=2, method=method, method_why="test"
        )
        assert timing["method"] == method and timing["ms"] > 0 and timing["project_tokens"] == 2
    with pytest.raises(ValueError, match="one of graphs, static, eager"):
        drafter_step_ms(runner, features, tokens, 12, repeats=1, method="compiled")
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    timing = time_on_cache(
        runner,
        cache,
        LAYERS,
        torch.device("cpu"),
        torch.float32,
        {"measure": True, "context_tokens": 12, "repeats": 1},
        {4: 3},
        target_method="graphs",
    )
    assert timing["method"] == "eager" and timing["by_block"][4]["method"] == "eager"  # a CPU has no graphs


def test_a_captured_step_keeps_the_drafter_and_buffers_it_replays_on_alive(monkeypatch):
    """A CUDA graph's replay holds none of the memory it reads: the step static_step returns must hold the
    captured closure (and so its drafter and buffers), or a replay reads freed memory. Here a stand-in for
    capture that, like graph.replay, keeps nothing of the closure it was given."""
    import gc
    import weakref

    from dflash_eval.evaluate import draft_timing

    captured = []

    def like_a_graph(step, _device, _graphs):
        captured.append(weakref.ref(step))
        return lambda: None

    monkeypatch.setattr(draft_timing, "capture", like_a_graph)
    features, tokens = _sample()
    step, _drafts = static_step(_runner(), features, tokens, 12, 4, 3, graphs=True)
    gc.collect()
    assert captured[0]() is not None, "the captured step (its drafter and buffers) was freed while replayable"
    del step
    gc.collect()
    assert captured[0]() is None


@pytest.mark.gpu
def test_the_graph_step_replays_the_static_steps_drafts_on_cuda():
    """On CUDA the captured step's replay drafts what the same step run eagerly drafts, and is timed as graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = _runner().to("cuda")
    features, tokens = (t.to("cuda") for t in _sample())
    eager, eager_drafts = static_step(runner, features, tokens, 12, 4, 3, graphs=False)
    replay, replay_drafts = static_step(runner, features, tokens, 12, 4, 3, graphs=True)
    eager()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(eager_drafts(), replay_drafts())
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    timing = time_on_cache(
        runner,
        cache,
        LAYERS,
        torch.device("cuda"),
        torch.float32,
        {"measure": True, "context_tokens": 12, "repeats": 3},
        {4: 3},
        "graphs",
        {16: 2},
    )
    assert timing["method"] == "graphs" and timing["by_block"][4]["ms"] > 0 and timing["by_budget"][16]["ms"] > 0
    trees = [TreeWork(16, 3, runner.lm_head.shape[0], torch.device("cuda")) for _ in range(2)]
    with torch.inference_mode():
        for graphs, tree in zip((False, True), trees):  # the DDTree step's top-k inside the graph, then the host's
            tree.after(static_step(runner, features, tokens, 12, 4, 3, graphs=graphs, tree=tree)[0])()
    torch.cuda.synchronize()
    assert torch.equal(trees[0].tree, trees[1].tree) and torch.equal(trees[0].top, trees[1].top)


def test_a_graph_timing_that_fails_falls_back_to_eager_and_says_why(monkeypatch, caplog):
    """An untested CUDA configuration must not fail the evaluation: the step is timed eagerly, and the record says
    why (here the graphs path forced on the CPU, its capture made to raise as CUDA would)."""
    from dflash_eval.evaluate import draft_timing

    runner = _runner()
    features, tokens = _sample()
    monkeypatch.setattr(draft_timing, "timing_method", lambda *_: ("graphs", "forced"))

    def refuse(*_args, **_kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(draft_timing, "capture", refuse)
    cache = SimpleNamespace(
        samples=[{"id": "0", "length": 20}],
        load_sample=lambda _id, _layers: SimpleNamespace(features=features, input_ids=tokens),
    )
    timing = time_on_cache(
        runner,
        cache,
        LAYERS,
        torch.device("cpu"),
        torch.float32,
        {"measure": True, "context_tokens": 12, "repeats": 1},
        {2: 1, 4: 3},
        "graphs",
    )
    assert timing["method"] == "eager" and timing["method_why"].startswith("CUDA graph timing failed: CUDA error")
    assert all(t["method"] == "eager" and t["ms"] > 0 for t in timing["by_block"].values())
    assert "timed eagerly instead" in caplog.text
