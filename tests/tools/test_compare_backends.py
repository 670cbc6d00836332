"""compare-backends: error statistics by hand, the CLI's clear error on CPU, and the real thing on a GPU."""

import json
import math

import pytest
import torch

from dflash_eval.cli import main
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.tools.compare_backends import (
    DrafterCheck,
    LayerError,
    compare_backends,
    format_table,
)
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target


def test_layer_error_statistics_by_hand():
    error = LayerError(3)
    reference = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    candidate = torch.tensor([[1.0, 1.0], [0.0, 2.0]])  # first token rotated 45 degrees, second exact
    error.add(candidate, reference)
    summary = error.summary()
    assert summary["tokens"] == 2
    assert summary["cos_min"] == pytest.approx(1 / math.sqrt(2))
    assert summary["cos_mean"] == pytest.approx((1 / math.sqrt(2) + 1) / 2)
    assert summary["rel_l2"] == pytest.approx(math.sqrt(1 / 5))  # |diff|^2 = 1, |ref|^2 = 1 + 4
    assert summary["max_abs"] == 1.0


def test_same_backend_twice_is_rejected():
    with pytest.raises(DflashEvalError, match="two different backends"):
        compare_backends(tiny_target(), [torch.arange(5)], [0], "cpu", ("torch", "torch"))


def test_cli_with_fla_on_cpu_is_a_clear_error_before_the_model_loads(tmp_path, capsys):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    record = {"id": "a", "prompt_token_ids": [5, 6, 7], "completion_token_ids": [8, 9]}
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    code = main(
        [
            "compare-backends",
            "--target",
            str(tmp_path / "target"),
            "--completions",
            str(tmp_path / "c.jsonl"),
            "--layers",
            "0,2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "kernel backend 'fla' cannot run on device 'cpu'" in err and "CUDA" in err
    assert "Qwen3_5ForCausalLM" not in err  # refused before loading the target


@pytest.mark.gpu
def test_fla_against_torch_on_cuda_with_a_drafter():
    target = tiny_target(layers=8, hidden=64).to("cuda", torch.bfloat16)
    drafter = tiny_drafter([1, 5], num_target_layers=8)
    runner = BlockDrafter(
        drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID
    ).to("cuda", torch.bfloat16)
    tokens = [torch.randint(2, 290, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 300)]
    check = DrafterCheck(runner, [1, 5], [10, 20], {1}, [None, None])
    result = compare_backends(target, tokens, [1, 5, 7], "cuda", ("fla", "torch"), drafter=check)
    print(format_table(result))
    assert [r["layer"] for r in result["layers"]] == [1, 5, 7]
    for row in result["layers"]:
        assert row["tokens"] == 340
        assert 0.99 < row["cos_mean"] <= 1.0 + 1e-6 and row["cos_min"] <= row["cos_mean"]
        assert 0 < row["rel_l2"] < 0.1  # close, but not the same arithmetic
    assert set(result["drafter"]["tau"]) == {"fla", "torch"}
    assert all(tau >= 1.0 for tau in result["drafter"]["tau"].values())
