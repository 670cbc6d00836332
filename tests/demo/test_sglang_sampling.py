"""The demo server's sampling pieces against SGLang 0.5.23's own code, dflash's `_sampling_probs`, and by hand.

SGLang's torch functions are run from its source (sglang/srt, read with ast and executed alone: their modules do
not import without SGLang's dependencies), with flashinfer's top_k/top_p_renorm_prob absent, against the demo's
`backend="torch"` (SGLang's fallback). What a CUDA server computes is flashinfer's (the demo's default backend):
no kernel runs here, so it is held to hand-made ties and to its definition read from the kernel source (a token
is kept iff the mass, and for top-k the count, strictly above its value is below top_p, below k). The verify kernel itself (sgl-kernel's CUDA
tree_speculative_sampling_target_only) is not in the wheel: it is checked by hand-made cases and by the one
property that makes it lossless, the emitted token's distribution.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_eval.demo.sglang_sampling import (
    draw,
    sampler_probs,
    target_only_verify,
    verify_probs,
)

# Hand-made logits: distinct values, a near-tie, a large gap, and (row 3) a run of equal values.
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, -1.0, 0.0, 3.0],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        [5.0, -5.0, 4.999, 0.0, 1.0, -2.0],
        [1.0, 1.0, 1.0, 0.0, 0.0, -1.0],
    ]
)
SETTINGS = [
    (0.7, 1.0, -1),
    (0.7, 0.95, -1),
    (1.0, 0.5, -1),
    (0.6, 1.0, 3),
    (0.7, 0.8, 4),
    (1.3, 0.9, 2),
    (0.7, 0.3, -1),
]


def _functions(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Execute the named top-level functions of one SGLang source file in `namespace`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in nodes} == set(names), path
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace


@pytest.fixture(scope="module")
def sglang_code(sglang_srt):
    from typing import Any, Optional

    namespace = {
        "torch": torch,
        "F": F,
        "Optional": Optional,
        "Any": Any,
        "top_k_renorm_prob": None,
        "top_p_renorm_prob": None,
        "_dflash_npu_top_k_top_p_renorm_prob": lambda *a, **k: None,
    }
    _functions(
        sglang_srt / "layers/sampler.py",
        ("top_p_normalize_probs_torch", "top_k_top_p_min_p_sampling_from_probs_torch"),
        namespace,
    )
    _functions(
        sglang_srt / "speculative/dflash_utils.py",
        ("_dflash_top_k_renorm_prob", "_dflash_top_p_renorm_prob", "build_speculative_verify_target_probs"),
        namespace,
    )
    return namespace


def _info(rows: int, temperature: float, top_p: float, top_k: int) -> types.SimpleNamespace:
    """SamplingBatchInfo's fields that the verify reads, as SGLang resolves a request (top_k -1 -> all)."""
    vocab = LOGITS.shape[1]
    k = vocab if top_k < 1 else top_k
    return types.SimpleNamespace(
        temperatures=torch.full((rows, 1), temperature),
        top_ks=torch.full((rows,), k),
        top_ps=torch.full((rows,), top_p),
        need_top_k_sampling=k < vocab,
        need_top_p_sampling=top_p < 1.0,
    )


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-top-k", "dense"])
@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_verify_probs_equal_sglangs_build_speculative_verify_target_probs(
    sglang_code, temperature, top_p, top_k, sparse
):
    build = sglang_code["build_speculative_verify_target_probs"]
    theirs = build(
        next_token_logits=LOGITS,
        sampling_info=_info(1, temperature, top_p, top_k),
        draft_token_num=LOGITS.shape[0],
        bs=1,
        use_sparse_topk=sparse,
    )[0]
    assert torch.allclose(verify_probs(LOGITS, temperature, top_p, top_k, backend="torch"), theirs, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.0, 0.3])
@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_sampler_probs_equal_sglangs_sampler(sglang_code, temperature, top_p, top_k, min_p):
    sample = sglang_code["top_k_top_p_min_p_sampling_from_probs_torch"]
    rows, vocab = LOGITS.shape
    probs = torch.softmax(LOGITS / temperature, dim=-1)
    _, weights, order, _ = sample(
        probs.clone(),
        torch.full((rows,), vocab if top_k < 1 else top_k),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
        min_p > 0,
        None,
        torch.zeros(rows, dtype=torch.long),
        return_filtered_probs=True,
    )
    theirs = torch.zeros_like(probs).scatter_(-1, order.long(), weights)
    theirs = theirs / theirs.sum(dim=-1, keepdim=True)
    assert torch.allclose(sampler_probs(LOGITS, temperature, top_p, top_k, min_p, backend="torch"), theirs, atol=1e-6)


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_verify_probs_equal_dflash_sampling_probs_where_they_agree(temperature, top_p, top_k):
    """dflash 0.1.0 `_sampling_probs` (top_k 0 = off) is the same top-k-then-top-p renormalisation."""
    from dflash.model import _sampling_probs

    theirs = _sampling_probs(LOGITS, temperature, top_p, max(top_k, 0))
    assert torch.allclose(verify_probs(LOGITS, temperature, top_p, top_k, backend="torch"), theirs, atol=1e-6)
    # flashinfer's value cut agrees on the rows of distinct values; row 3's tie can straddle the cut
    assert torch.allclose(verify_probs(LOGITS[:3], temperature, top_p, top_k), theirs[:3], atol=1e-6)


def test_where_dflash_and_sglang_differ_by_hand():
    """A cumulative mass exactly at top_p: SGLang's torch fallback keeps the next token (`cumsum - p <= top_p`),
    dflash and flashinfer drop it (`< top_p`, by value); and with top-k and top-p both set the sampler's first token
    cuts top-p before renormalising."""
    from dflash.model import _sampling_probs

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert float(torch.softmax(logits, dim=-1)[0, 0]) == 0.5  # the tie is exact
    # exclusive cumulative mass [0, 0.5, 0.75]: the fallback keeps 0.5 <= 0.5 (the second token), dflash does not
    assert torch.allclose(
        verify_probs(logits, 1.0, 0.5, backend="torch"), torch.tensor([[2 / 3, 1 / 3, 0.0]]), atol=1e-6
    )
    assert torch.allclose(_sampling_probs(logits, 1.0, 0.5), torch.tensor([[1.0, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(verify_probs(logits, 1.0, 0.5), torch.tensor([[1.0, 0.0, 0.0]]), atol=1e-6)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # verify: top-2 renormalised to [4/7, 3/7], then top-p 0.5 keeps only the first (4/7 > 0.5)
    assert torch.allclose(verify_probs(logits, 1.0, 0.5, 2), torch.tensor([[1.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    # sampler: top-p 0.5 on the unfiltered mass keeps ranks 0 and 1 (0.4 <= 0.5), top-2 keeps both
    assert torch.allclose(sampler_probs(logits, 1.0, 0.5, 2), torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]), atol=1e-6)


def _by_definition(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """flashinfer's kept set as its kernels define it, token by token: fewer than k tokens and less than top_p of
    the mass strictly above this token's value (TopPRenormProbKernel's `probs > low`, the joint kernel's
    `count < k && value < p`)."""
    out = torch.zeros_like(probs)
    for r, row in enumerate(probs.tolist()):
        for t, value in enumerate(row):
            above = [v for v in row if v > value]
            if len(above) < (top_k if top_k > 0 else len(row)) and sum(above) < top_p:
                out[r, t] = value
    return out / out.sum(dim=-1, keepdim=True)


def test_flashinfer_top_p_keeps_tied_probabilities_together():
    """[0.4, 0.3, 0.3] at top_p 0.5: 0.4 < 0.5 lies above either 0.3, so flashinfer keeps both (the cut is by
    value); SGLang's torch fallback splits the tie by sort order (exclusive mass 0.7 > 0.5 drops the second)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.3]]))
    assert torch.allclose(verify_probs(logits, 1.0, 0.5), torch.tensor([[0.4, 0.3, 0.3]]), atol=1e-6)
    assert sorted(verify_probs(logits, 1.0, 0.5, backend="torch")[0].tolist()) == pytest.approx([0.0, 3 / 7, 4 / 7])
    # the first token, joint filter: top_k 2 keeps both tied 0.3s (one token above each), top_p too
    assert torch.allclose(sampler_probs(logits, 1.0, 0.9, 2), torch.tensor([[0.4, 0.3, 0.3]]), atol=1e-6)
    assert sorted(sampler_probs(logits, 1.0, 0.9, 2, backend="torch")[0].tolist()) == pytest.approx([0.0, 3 / 7, 4 / 7])


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_flashinfer_filters_equal_their_definition(temperature, top_p, top_k):
    """verify: exactly k by torch.topk, then the value cut on the renormalised top-k; the first token: the joint
    filter on the unfiltered distribution (its support contains the verify's)."""
    probs = torch.softmax(LOGITS / temperature, dim=-1)
    k = LOGITS.shape[1] if top_k < 1 else top_k
    values, indices = torch.topk(probs, k, dim=-1)
    verify = torch.zeros_like(probs).scatter_(
        -1, indices, _by_definition(values / values.sum(-1, keepdim=True), top_p, -1)
    )
    assert torch.allclose(verify_probs(LOGITS, temperature, top_p, top_k), verify, atol=1e-6)
    first = sampler_probs(LOGITS, temperature, top_p, top_k)
    assert torch.allclose(first, _by_definition(probs, top_p, top_k), atol=1e-6)
    assert bool(((verify > 0) <= (first > 0)).all())


def test_target_only_verify_by_hand():
    """candidates [last, d1, d2, d3]; p(d1) = 0.6, p(d2) = 0.3, p(d3) = 0.9 at their rows."""
    probs = torch.tensor([[0.6, 0.2, 0.2, 0.0], [0.5, 0.3, 0.2, 0.0], [0.05, 0.05, 0.9, 0.0], [0.0, 0.0, 0.0, 1.0]])
    candidates = [3, 0, 1, 2]
    # coin 0 checks d1, coin 1 (d1's) checks d2: 0.35 > 0.3 rejects; the bonus from row 1 without token 1
    accepted, bonus = target_only_verify(candidates, probs, [0.59, 0.35, 0.0, 0.0], final_coin=0.99)
    assert (accepted, bonus) == (1, 2)  # residual [0.5, 0, 0.2, 0] -> cumulative [0.5, 0.5, 0.7]: 0.99 * 0.7 -> 2
    accepted, bonus = target_only_verify(candidates, probs, [0.59, 0.35, 0.0, 0.0], final_coin=0.5)
    assert (accepted, bonus) == (1, 0)  # 0.5 * 0.7 = 0.35 < 0.5
    # every draft accepted: the bonus from the last row, unmasked
    assert target_only_verify(candidates, probs, [0.59, 0.29, 0.85, 0.5], final_coin=0.1) == (3, 3)
    # the first draft rejected: its mass removed at row 0 -> [0, 0.2, 0.2, 0]
    assert target_only_verify(candidates, probs, [0.61, 0.0, 0.0, 0.0], final_coin=0.49) == (0, 1)
    assert target_only_verify(candidates, probs, [0.61, 0.0, 0.0, 0.0], final_coin=0.51) == (0, 2)
    # lossy thresholds: threshold_single 0.5 accepts d1 (0.6 >= 0.5) whatever the coin; acc 0.5 doubles p(d2)
    # (and d3, 0.9 >= 0.5); coin 0.65 > 0.3 / 0.5 rejects d2
    lossy = {"threshold_single": 0.5, "threshold_acc": 0.5}
    assert target_only_verify(candidates, probs, [0.99, 0.55, 0.99, 0.0], 0.0, **lossy)[0] == 3
    assert target_only_verify(candidates, probs, [0.99, 0.65, 0.99, 0.0], 0.0, **lossy)[0] == 1


def test_draw_is_the_inverse_cdf():
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25])
    assert [draw(probs, c) for c in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999)] == [0, 0, 2, 2, 3, 3]


def test_target_only_verification_is_lossless():
    """Whatever the draft, the first emitted token after a verification is distributed as p (rows 0): the
    frequency over 6000 seeded draws is within 4.5 standard errors of p for every token."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = p.expand(3, 4).clone()
    for draft in (0, 2, 3):
        counts = torch.zeros(4)
        for _ in range(6000):
            coins = torch.rand(3, generator=generator).tolist()
            accepted, bonus = target_only_verify(
                [1, draft, 0], probs, coins, float(torch.rand((), generator=generator))
            )
            counts[draft if accepted else bonus] += 1
        freq = counts / 6000
        bound = 4.5 * torch.sqrt(p * (1 - p) / 6000) + 1e-9
        assert torch.all((freq - p).abs() <= bound), (draft, freq)
