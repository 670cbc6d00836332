"""Tiny random models for fast tests: a hybrid Qwen3.5 target, a demo-shaped one saved as the demo saves its
target, and a reference DFlash drafter."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from dflash_eval.demo import target
from dflash_eval.demo.corpus import select_sources
from dflash_eval.demo.tokenizer import build_tokenizer
from dflash_eval.io_utils import sha256_file

VOCAB = 300
MASK_ID = 299


def tiny_target(seed: int = 0, layers: int = 4, hidden: int = 64) -> Qwen3_5ForCausalLM:
    """A 3 linear : 1 full attention Qwen3.5 target in float32."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    return Qwen3_5ForCausalLM(config).eval()


def tiny_attention_target(layers: int = 3) -> Qwen3ForCausalLM:
    """A Qwen3 target of attention layers only (no Gated DeltaNet) in float32, seed 0: the loops' non-hybrid case."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_drafter_config(
    layer_ids: list[int], hidden: int = 64, block_size: int = 4, window: int | None = 5, num_target_layers: int = 4
) -> Qwen3Config:
    """Drafter config shaped like the z-lab ones: a sliding layer then a full-attention layer.

    window=None gives a drafter of full-attention layers only.
    """
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        layer_types=["sliding_attention" if window else "full_attention", "full_attention"],
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": layer_ids},
    )


DFLASH2_SETTINGS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def tiny_drafter(layer_ids: list[int], seed: int = 1, dflash2: bool = False, **kwargs):
    """A reference drafter; `dflash2` gives a DFlash2DraftModel (block convolutions, candidate selector)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    torch.manual_seed(seed)
    config = tiny_drafter_config(layer_ids, **kwargs)
    if dflash2:
        config.architectures = ["DFlash2DraftModel"]
        config.dflash_config.update(DFLASH2_SETTINGS)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(config).eval()
    with torch.no_grad():  # post_init leaves norms at 1 and projections small; make the signal visible
        for name, param in model.named_parameters():
            if param.dim() > 1:  # (DFlash2's convolution kernels and codebooks start uninitialised)
                param.normal_(0, 0.05 if "codebook" in name or "conv" in name else 0.2)
    return model


def layer_features(model, tokens: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The drafter's context features of one sequence: the target's hidden states after each layer id, concatenated."""
    with torch.no_grad():
        hidden = model(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)


def greedy_sequences(model, prompt_lens: list[int], layer_ids: list[int], max_new: int, eos: int):
    """(prompts, training sequences): seeded random prompts of the given lengths, each with the target's greedy
    completion and its features (what the tests train a drafter on and evaluate it against)."""
    from dflash_eval.demo.drafters import TrainingSequence

    prompts = [
        torch.randint(2, 290, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(prompt_lens)
    ]
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(
                prompt[None], max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )[0]
            sequences.append(TrainingSequence(ids, layer_features(model, ids, layer_ids), len(prompt)))
    return prompts, sequences


def train_briefly(drafter, runner, sequences, steps: int = 120) -> None:
    """A few optimizer steps of the demo's block loss, so acceptance is far from both 1 and B (seeded)."""
    import random

    from dflash_eval.demo.drafters import block_loss

    optimizer, rng = torch.optim.AdamW(drafter.parameters(), lr=3e-3), random.Random(0)
    drafter.train()
    for _ in range(steps):
        loss = block_loss(runner, sequences[rng.randrange(len(sequences))], 16, rng, decay=4.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()


def build_demo_target(
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    steps: int = 0,
    hidden_size: int = 64,
) -> Path:
    """A seconds-fast demo-shaped target for tests: random init (or `steps` short steps).

    Without `tokenizer_dir`, a small tokenizer (vocab 512, 300 KB of stdlib) is built inside
    `out_dir` first. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    if tokenizer_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            build_tokenizer(Path(tmp), seed=seed, vocab_size=512, corpus_bytes=300_000)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            tokenizer_sha = sha256_file(Path(tmp) / "tokenizer.json")
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer_sha = sha256_file(Path(tokenizer_dir) / "tokenizer.json")
    config = target.config_for(
        tokenizer,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        head_dim=16,
        linear_head_dim=16,
        max_position_embeddings=4096,
    )
    model = target.new_model(config, seed)
    if steps:
        s = target.TrainSettings(steps=steps, batch_size=2, seq_len=64, warmup=1, corpus_bytes=300_000)
        files = select_sources(seed=seed, max_bytes=s.corpus_bytes)
        target.train(model, target.packed_windows(tokenizer, files, seed, steps * 2, s.seq_len), s, seed)
    info = {
        "kind": "dflash-eval tiny test target",
        "seed": seed,
        "steps": steps,
        "tokenizer_json_sha256": tokenizer_sha,
    }
    target.save_target(model, tokenizer, out_dir, info)
    return out_dir
