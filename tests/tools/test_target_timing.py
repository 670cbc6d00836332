"""The target's step profile, measured on a tiny hybrid target: the format the report reads."""

import json
import logging

import pytest
import torch

from dflash_eval import methods
from dflash_eval.cache.serving_profile import load_profile
from dflash_eval.extract.backends import BackendUnavailable
from dflash_eval.tools import target_timing as profiling
from dflash_eval.tools.target_timing import (
    measure_target,
    sizes_to_measure,
    write_target_profile,
)
from tests.support.tiny import tiny_target

PROFILE_NAME = "cpu-float32-torch.json"


@pytest.fixture(autouse=True)
def short_cap(monkeypatch):
    monkeypatch.setattr(profiling, "SECONDS_PER_SIZE", 0.2)  # a CPU under load never settles within ±2%


def test_measured_profile_is_a_valid_profile(tmp_path, monkeypatch):
    profile = measure_target(tiny_target().eval(), context_tokens=32, repeats=2, verify_tokens=[2, 5])
    assert sorted(profile["t_verify_ms"]) == ["1", "2", "5"] and profile["t_ar_ms"] == profile["t_verify_ms"]["1"]
    assert profile["hybrid"] is True and profile["seconds_per_size"] == 0.2
    for n, (low, high) in profile["spread"]["t_verify_ms"].items():
        assert 0 < low <= profile["t_verify_ms"][n] <= high
        assert profile["spread"]["repeats"][n] >= 2
    monkeypatch.setattr(profiling, "sizes_to_measure", lambda options: [1, 3])
    path = tmp_path / PROFILE_NAME
    written = write_target_profile(
        tiny_target().eval(), path, {"context_tokens": 16, "repeats": 1, "stamps": {"code_identity": "x"}}
    )
    assert load_profile(path)["t_verify_ms"][1] > 0 and json.loads(path.read_text())["t_ar_ms"] == written["t_ar_ms"]
    assert "previous" not in written and written["code_identity"] == "x"


def test_a_failed_timing_fails_and_writes_nothing(tmp_path, monkeypatch):
    """The profile is its own rule's output: a timing that fails fails that job, loudly, and writes nothing."""

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(profiling, "measure_target", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        write_target_profile(tiny_target(), tmp_path / PROFILE_NAME, {"context_tokens": 16, "repeats": 1})
    assert not (tmp_path / PROFILE_NAME).exists()


def test_a_failed_graph_timing_is_timed_eagerly_and_says_why(tmp_path, monkeypatch, caplog):
    """The graph path (new for hybrids) must never cost a profile: where it fails, the HF forward times it."""

    def no_graphs(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(profiling, "timing_method", lambda model: ("graphs", "as on CUDA"))
    monkeypatch.setattr(profiling, "_static_steps", no_graphs)
    path = tmp_path / PROFILE_NAME
    write_target_profile(
        tiny_target(),
        path,
        {"context_tokens": 16, "repeats": 2, "ddtree_budgets": [], "block_sizes": [], "drafter_blocks": [2]},
    )
    saved = json.loads(path.read_text())
    assert saved["method"] == "eager" and "RuntimeError: operation not permitted" in saved["method_why"]
    assert "the graph-timed profile failed (RuntimeError" in caplog.text


def test_only_the_sizes_the_configured_methods_verify_are_measured():
    """1 (T_AR), each drafter's own block and the evaluation's block_sizes that fit it, N + 1 per DDTree budget."""
    sizes = sizes_to_measure({"block_sizes": [4, 24], "ddtree_budgets": [8, 100], "drafter_blocks": [8, 16]})
    assert sizes == [1, 4, 8, 9, 16, 101]  # 24 fits neither drafter; 9 = ddtree-8's N + 1
    assert sizes_to_measure({"block_sizes": "all", "ddtree_budgets": None, "drafter_blocks": [8]}) == list(range(1, 9))
    assert sizes_to_measure({"block_sizes": [], "ddtree_budgets": [64], "drafter_blocks": [8]}) == [1, 8, 65]
    # a drafter's block not known (its config.json not readable): every chain block 2..16 and the listed ones
    assert sizes_to_measure({"block_sizes": [24], "ddtree_budgets": [8, 100]}) == [1, *range(2, 17), 24, 101]


def test_the_chain_blocks_are_evaluations_own_rule():
    """target_timing repeats evaluation's block-size rule and methods' N + 1 (imported, a change to evaluation's
    code would re-time the target): held equal here."""
    from dflash_eval.evaluate.stage import requested_block_sizes

    for requested in ([], [2, 4], [4, 24], "all"):
        for own in (2, 8, 16):
            assert profiling.chain_blocks(requested, own) == set(requested_block_sizes(requested, own))
    assert 101 == methods.verified_tokens(methods.tree_method(100))
    assert 24 == methods.verified_tokens(methods.chain_method(24))


def test_a_second_profile_is_compared_with_the_first_and_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(profiling, "sizes_to_measure", lambda options: [1, 2])
    old = {"t_ar_ms": 1e-6, "t_verify_ms": {"1": 1e-6, "2": 1e-6}, "device": "cpu", "context_tokens": 16}
    (tmp_path / PROFILE_NAME).write_text(json.dumps(old))  # far faster than any real step: > 5% apart
    with caplog.at_level(logging.WARNING):
        written = write_target_profile(
            tiny_target().eval(), tmp_path / PROFILE_NAME, {"context_tokens": 16, "repeats": 1}
        )
    assert written["previous"]["agree"] is False and written["previous"]["beyond_5_percent"] == ["1", "2"]
    assert "differ from the previous measurement by more than 5%" in caplog.text


def _attention_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).eval()


def test_the_static_cache_path_and_the_method_the_profile_names():
    """On a CPU the default is the HF forward (no graphs); `static` runs the graphs' code path eagerly."""
    target = _attention_target()
    assert profiling.timing_method(target) == ("eager", "no CUDA graphs on this device")
    profile = measure_target(target, context_tokens=40, repeats=2, verify_tokens=[3, 17], method="static")
    assert profile["method"] == "static" and sorted(profile["t_verify_ms"], key=int) == ["1", "3", "17"]
    assert all(profile["spread"]["repeats"][n] >= 3 for n in profile["t_verify_ms"])
    assert profile["target"] == profiling.target_identity(target) and profile["target"].startswith("Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="one of graphs, static, eager"):
        measure_target(target, 8, 1, [2], method="compiled")


def test_a_hybrid_target_has_the_static_path_too_with_its_kernels_named(monkeypatch):
    """A Gated DeltaNet hybrid runs the validated hybrid loop's forward (speedup/forwards/hybrid_target.py): its one-token
    step commits the states as a decode step does, an n-token verify leaves them and records its tokens."""
    from dflash_eval.speedup.forwards import hybrid_target

    target, made = tiny_target(seed=0), []
    real = hybrid_target.StaticHybridTarget.__init__

    def spy(self, model, max_len, kernels, layer_ids=None):
        made.append(kernels.name)
        real(self, model, max_len, kernels, layer_ids)

    monkeypatch.setattr(hybrid_target.StaticHybridTarget, "__init__", spy)
    profile = measure_target(
        target, context_tokens=40, repeats=2, verify_tokens=[3, 17], method="static", backend="torch"
    )
    assert made == ["torch"] and profile["hybrid"] is True and profile["method"] == "static"
    assert sorted(profile["t_verify_ms"], key=int) == ["1", "3", "17"] and profile["t_ar_ms"] > 0
    with pytest.raises(BackendUnavailable, match="cannot run on device 'cpu'"):  # named: never silently another
        measure_target(target, context_tokens=8, repeats=1, verify_tokens=[2], method="static", backend="fla")


def test_a_hybrid_verify_is_timed_with_its_state_commit_which_leaves_the_states(monkeypatch):
    """The estimate's T_verify(n > 1) of a hybrid is the validated loop's whole verify: the recording forward and
    the commit's replay (its accept step's GDN term, 4-12% of a step on the H200 shapes), at 0 kept: the states
    after each timed verify are those before it. T_AR's one-token step commits in its forward, no replay."""
    from dflash_eval.speedup.forwards import hybrid_target

    calls: list[tuple[str, int, int | bool]] = []
    before: list[torch.Tensor] = []
    real_forward, real_keep = hybrid_target.StaticHybridTarget.forward, hybrid_target.StaticHybridTarget.keep

    def gdn_states(target) -> list[torch.Tensor]:
        return [t.clone() for layer in target.gdn.values() for t in (layer.conv, layer.recurrent)]

    def forward(self, ids, start, features=True, span=None, tree=None, commit=True):
        calls.append(("forward", ids.shape[1], commit))
        if not commit:
            before[:] = gdn_states(self)
        return real_forward(self, ids, start, features, span, tree, commit)

    def keep(self, kept, n):
        calls.append(("keep", n, int(kept)))
        real_keep(self, kept, n)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(before, gdn_states(self), strict=True))

    monkeypatch.setattr(hybrid_target.StaticHybridTarget, "forward", forward)
    monkeypatch.setattr(hybrid_target.StaticHybridTarget, "keep", keep)
    profile = measure_target(
        tiny_target(seed=0), context_tokens=40, repeats=2, verify_tokens=[3], method="static", backend="torch"
    )
    assert profile["verify_includes_state_commit"] is True
    assert ("forward", 1, True) in calls and not any(c[0] == "keep" and c[1] == 1 for c in calls)
    verifies = [c for c in calls if c[1] == 3]
    assert len(verifies) >= 4 and verifies == [("forward", 3, False), ("keep", 3, 0)] * (len(verifies) // 2)


def test_the_total_cap_bounds_the_profile():
    """With nothing left of the total, each size stops at 3 calls (the fewest a spread needs), unstable."""
    profile = measure_target(
        _attention_target(), context_tokens=16, repeats=10, verify_tokens=[2, 4], total_seconds=0.0
    )
    assert profile["spread"]["repeats"] == {"1": 3, "2": 3, "4": 3} and profile["spread"]["unstable"] == [1, 2, 4]
    assert profile["total_seconds"] == 0.0


def test_a_profile_of_another_target_is_not_compared(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(profiling, "sizes_to_measure", lambda options: [1])
    target = tiny_target().eval()
    options = {"context_tokens": 16, "repeats": 1}
    other = {
        "t_ar_ms": 1e-6,
        "t_verify_ms": {"1": 1e-6},
        "device": "cpu",
        "context_tokens": 16,
        "target": "another config sha256:0",
    }
    (tmp_path / PROFILE_NAME).write_text(json.dumps(other))
    assert "previous" not in write_target_profile(target, tmp_path / PROFILE_NAME, options)
    same = {**other, "target": profiling.target_identity(target), "method": "eager"}
    (tmp_path / PROFILE_NAME).write_text(json.dumps(same))
    with caplog.at_level(logging.WARNING):
        written = write_target_profile(target, tmp_path / PROFILE_NAME, options)
    assert written["previous"]["found_at"] == str(tmp_path / PROFILE_NAME) and written["previous"]["agree"] is False
    assert f"serving profile {tmp_path / PROFILE_NAME} (against the one it replaces, found there)" in caplog.text


@pytest.mark.gpu
def test_a_hybrid_target_on_cuda_is_timed_as_graphs_with_fla():
    """On a GPU with fla: the hybrid's profile is graph-timed (the validated hybrid loop's forward), by default."""
    target = tiny_target(seed=0).to("cuda", torch.bfloat16)
    method, why = profiling.timing_method(target)
    assert method == "graphs" and "Gated DeltaNet hybrid" in why
    profile = measure_target(target, context_tokens=40, repeats=3, verify_tokens=[3, 17], backend="fla")
    assert profile["method"] == "graphs" and profile["hybrid"] is True and profile["t_ar_ms"] > 0
    assert sorted(profile["t_verify_ms"], key=int) == ["1", "3", "17"]
