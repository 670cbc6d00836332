"""The demo drafters' training data: the same bits whatever number of processes computes it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_eval.demo.drafters import greedy_sequences
from tests.support.tiny import build_demo_target


def test_greedy_sequences_are_bit_identical_in_worker_processes(tmp_path: Path) -> None:
    target_dir = build_demo_target(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    layer_ids = [0, 2]
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    alone = greedy_sequences(target, target_dir, tokenizer, layer_ids, 3, 12, seed=0, workers=1)
    # the drafter's initialisation draws from the RNG next: generating must not move it
    assert torch.equal(torch.get_rng_state(), rng_before)
    pooled = greedy_sequences(target, target_dir, tokenizer, layer_ids, 3, 12, seed=0, workers=2)
    assert [s.prompt_len for s in pooled] == [s.prompt_len for s in alone]
    for a, b in zip(alone, pooled, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.features, b.features)  # bit for bit, not close
    assert all(len(s.tokens) > s.prompt_len for s in alone)
