"""The renormalisation against its two sources, on hand-made logits: dflash 0.1.0's `_sampling_probs` (imported)
and SGLang 0.5.23's DFlash verify (`build_speculative_verify_target_probs`, its functions read from the wheel's
source, both its sparse top-k path and its dense one), and where the two differ (a top-p boundary tie)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from torch.nn import functional as F

from dflash_eval.cache.sampling import (
    SamplingParams,
    from_record,
    sampling_probs,
    token_logprobs,
)
from dflash_eval.errors import DflashEvalError

CASES = [  # (temperature, top_p, top_k in SGLang's spelling)
    (1.0, 1.0, -1),
    (0.7, 1.0, -1),
    (0.7, 0.9, -1),
    (1.3, 0.5, -1),
    (0.7, 1.0, 3),
    (0.7, 0.8, 5),
    (0.3, 0.95, 40),
    (1.0, 0.999, 2),
    (2.0, 0.3, 1),
]


def _logits(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=generator) * 3
    logits[0, :5] = torch.tensor([4.0, 4.0, 1.0, 1.0, 0.5])  # ties at the top, as bf16 logits have them
    return logits


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_dflash_convention_is_dflash_sampling_probs(temperature, top_p, top_k):
    from dflash.model import _sampling_probs

    logits = _logits()
    params = SamplingParams(temperature, top_p, top_k)
    expected = _sampling_probs(logits, temperature, top_p, params.dflash_top_k)
    assert torch.equal(sampling_probs(logits, params, "dflash"), expected)


def _sglang_functions(srt: Path) -> dict[str, Any]:
    """SGLang's verify-probability functions, compiled from its source (the package itself needs its deps)."""
    wanted = {
        srt / "speculative" / "dflash_utils.py": (
            "build_speculative_verify_target_probs",
            "_dflash_top_k_renorm_prob",
            "_dflash_top_p_renorm_prob",
        ),
        srt / "layers" / "sampler.py": ("top_p_normalize_probs_torch",),
    }
    namespace: dict[str, Any] = {
        "torch": torch,
        "F": F,
        "Any": Any,
        "Optional": Optional,
        "top_k_renorm_prob": None,
        "top_p_renorm_prob": None,  # sgl_kernel absent
        "_dflash_npu_top_k_top_p_renorm_prob": lambda probs, **_: None,
    }
    for path, names in wanted.items():
        tree = ast.parse(path.read_text())
        found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
        assert sorted(n.name for n in found) == sorted(names), f"{path} changed"
        exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _sglang_probs(functions, logits, temperature, top_p, top_k, sparse):
    rows = logits.shape[0]
    vocab = logits.shape[-1]
    info = SimpleNamespace(
        temperatures=torch.full((rows, 1), temperature),
        top_ks=torch.full((rows,), top_k if top_k > 0 else 1 << 30, dtype=torch.int32),
        top_ps=torch.full((rows,), top_p),
        need_top_k_sampling=0 < top_k < vocab,
        need_top_p_sampling=top_p < 1.0,
    )
    return functions["build_speculative_verify_target_probs"](
        next_token_logits=logits, sampling_info=info, draft_token_num=1, bs=rows, use_sparse_topk=sparse
    )[:, 0]


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-topk", "dense"])
@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_sglang_convention_is_sglang_verify(sglang_srt, temperature, top_p, top_k, sparse):
    functions = _sglang_functions(sglang_srt)
    logits = _logits(1)
    mine = sampling_probs(logits, SamplingParams(temperature, top_p, top_k), "sglang")
    torch.testing.assert_close(
        mine, _sglang_probs(functions, logits, temperature, top_p, top_k, sparse), rtol=1e-6, atol=1e-7
    )


def test_the_conventions_differ_only_at_a_top_p_tie(sglang_srt):
    """Mass before the third token exactly 0.75 = top_p: SGLang keeps it, dflash drops it (both checked at source)."""
    from dflash.model import _sampling_probs

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 1e-9]]))  # before-masses 0, 0.5, 0.75: exact in float
    params = SamplingParams(1.0, 0.75, -1)
    dflash, sglang = sampling_probs(logits, params, "dflash"), sampling_probs(logits, params, "sglang")
    assert torch.equal(dflash, _sampling_probs(logits, 1.0, 0.75, 0))
    torch.testing.assert_close(sglang, _sglang_probs(_sglang_functions(sglang_srt), logits, 1.0, 0.75, -1, False))
    assert dflash[0, 2] == 0
    torch.testing.assert_close(sglang[0, :3], torch.tensor([0.5, 0.25, 0.25]))
    torch.testing.assert_close(dflash[0, :2], torch.tensor([2 / 3, 1 / 3]))


def test_hand_computed_case():
    """T = 0.5 on logits log([0.5, 0.3, 0.2]): p ∝ [0.25, 0.09, 0.04]; top-k 2 then renormalised."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    probs = sampling_probs(logits, SamplingParams(0.5, 1.0, 2))
    torch.testing.assert_close(probs, torch.tensor([0.25 / 0.34, 0.09 / 0.34, 0.0]))
    logp = token_logprobs(logits[None].expand(3, -1), torch.tensor([0, 1, 2]), SamplingParams(0.5, 1.0, 2))
    torch.testing.assert_close(logp[:2], torch.log(torch.tensor([0.25 / 0.34, 0.09 / 0.34])))
    assert logp[2] == float("-inf")


def test_record_parsing_and_errors():
    assert from_record({"id": "a"}, "f.jsonl") is None
    params = from_record(
        {"id": "a", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "seed": 3}}, "f.jsonl"
    )
    assert params == SamplingParams(0.7, 0.95, -1, 0.0) and params.dflash_top_k == 0
    with pytest.raises(DflashEvalError, match=r"f\.jsonl: record 'b'.*out of range"):
        from_record({"id": "b", "sampling": {"temperature": 0.0}}, "f.jsonl")
    with pytest.raises(DflashEvalError, match=r"f\.jsonl: record 'c' has a malformed"):
        from_record({"id": "c", "sampling": {"top_p": 0.9}}, "f.jsonl")
