"""The demo target: a tiny hybrid Qwen3.5/3.6-style model, trained for minutes on CPU.

It has the structure that makes real evaluations go wrong (Gated DeltaNet `linear_attention`
layers 3:1 with gated `full_attention` layers, an untied LM head, ChatML, an eos that is not the
tokenizer's `<|endoftext|>`), at a size that trains and serves on two CPU cores. It is trained on
stdlib code formatted as chat turns so that its greedy completions look like code, which gives a
drafter something learnable to predict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from dflash_eval.demo.build_device import prepare_build_device
from dflash_eval.demo.corpus import (
    SourceFile,
    chat_examples,
    corpus_fingerprint,
    select_sources,
)
from dflash_eval.demo.tokenizer import BUILD_INFO, ENDOFTEXT, IM_END
from dflash_eval.extract.backends import bind_backend
from dflash_eval.io_utils import sha256_file

log = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"


def qwen36_layer_types(num_layers: int) -> list[str]:
    """Qwen3.6's pattern: three Gated DeltaNet layers, then one gated full-attention layer."""
    if num_layers % 4:
        raise ValueError(f"num_layers must be a multiple of 4 for the 3:1 pattern, got {num_layers}")
    return [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(num_layers)]


def make_target_config(
    vocab_size: int,
    *,
    eos_token_id: int,
    bos_token_id: int | None = None,
    pad_token_id: int | None = None,
    num_hidden_layers: int = 8,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    linear_num_key_heads: int = 1,
    linear_num_value_heads: int = 2,
    linear_head_dim: int = 32,
    max_position_embeddings: int = 8192,
) -> Qwen3_5TextConfig:
    """Config of a small `Qwen3_5ForCausalLM`: float32, untied head, Qwen3.6 layer pattern.

    Gated DeltaNet heads are few (1 key, 2 value heads, grouped like Qwen3.6's 16:48): on CPU the
    torch chunked delta rule costs per head, and it dominates training time.
    """
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        layer_types=qwen36_layer_types(num_hidden_layers),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=["Qwen3_5ForCausalLM"],
    )


def config_for(tokenizer: PreTrainedTokenizerBase, **overrides: int) -> Qwen3_5TextConfig:
    ids = {
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    }
    return make_target_config(len(tokenizer), **ids, **overrides)


def _generation_config(config: Qwen3_5TextConfig) -> GenerationConfig:
    """Greedy by default, stopping at `<|im_end|>` as the served chat model must."""
    return GenerationConfig(
        do_sample=False,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        max_new_tokens=256,
    )


# ---------------------------------------------------------------- training data


def packed_windows(
    tokenizer: PreTrainedTokenizerBase, files: list[SourceFile], seed: int, count: int, seq_len: int
) -> torch.Tensor:
    """`count` windows of `seq_len` ids, each starting at a conversation start (as prompts do)."""
    stream = chat_examples(files, seed=seed)
    windows: list[list[int]] = []
    current: list[int] = []
    while len(windows) < count:
        batch = [tokenizer.apply_chat_template(m, tokenize=False) for m in itertools.islice(stream, 64)]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            current.extend(ids)
            if len(current) >= seq_len:
                windows.append(current[:seq_len])
                current = []
                if len(windows) == count:
                    break
    return torch.tensor(windows, dtype=torch.long)


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser schedule of the demo target; defaults fit ~4 min on two CPU cores."""

    steps: int = 240
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    corpus_bytes: int = 3_000_000


def _lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup then cosine decay to 10% (short runs need a high average rate)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Qwen3_5ForCausalLM, data: torch.Tensor, s: TrainSettings, seed: int) -> list[float]:
    """AdamW on next-token loss over `data` windows (on the CPU; each batch moves to the model's device); returns
    the per-step losses."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    # Epochs of seeded permutations: every window is seen once before any repeats.
    epochs = math.ceil(s.steps * s.batch_size / data.shape[0])
    order = torch.cat([torch.randperm(data.shape[0], generator=generator) for _ in range(epochs)])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    losses: list[float] = []
    with logging_redirect_tqdm():
        bar = tqdm(range(s.steps), desc="demo target", unit="step")
        for step in bar:
            batch = data[order[step * s.batch_size : (step + 1) * s.batch_size]].to(device)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, s)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if step % 25 == 0 or step == s.steps - 1:
                log.info("step %d loss %.4f lr %.2e", step, losses[-1], _lr_at(step, s))
    model.eval()
    return losses


# ---------------------------------------------------------------- saving


def save_target(model: Qwen3_5ForCausalLM, tokenizer: PreTrainedTokenizerBase, out_dir: Path, info: dict) -> None:
    """Weights (safetensors, float32), config, generation config and tokenizer in one directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = _generation_config(model.config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def new_model(config: Qwen3_5TextConfig, seed: int) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(config).float()


def build_target(
    tokenizer_dir: Path,
    out_dir: Path,
    seed: int = 0,
    steps: int | None = None,
    settings: TrainSettings | None = None,
    threads: int = 2,
    device: str = "cpu",
) -> dict:
    """Train the demo target on chat-formatted stdlib code on `device` and save it servable; returns build info.

    The weights start from the same seeded CPU initialisation on every device; `threads` are the CPU's torch
    threads (on the CPU they decide the bits)."""
    s = settings or TrainSettings()
    if steps is not None:
        s = TrainSettings(**{**asdict(s), "steps": steps})
    torch.set_num_threads(threads)
    torch_device = prepare_build_device(device)
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    t0 = time.perf_counter()
    files = select_sources(seed=seed, max_bytes=s.corpus_bytes)
    # At most one window per sampled row; fewer is fine (rows then repeat).
    data = packed_windows(tokenizer, files, seed, min(s.steps * s.batch_size, 4096), s.seq_len)
    t_data = time.perf_counter() - t0
    model = new_model(config_for(tokenizer), seed).to(torch_device)
    losses = train(model, data, s, seed)
    model.to("cpu")
    t_train = time.perf_counter() - t0 - t_data
    info = {
        "kind": "dflash-eval demo target",
        "seed": seed,
        "train": asdict(s),
        "threads": threads,
        "device": device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": losses[0] if losses else None,
        "loss_last_10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1)},
        "tokenizer_json_sha256": sha256_file(tokenizer_dir / "tokenizer.json"),
        "corpus": corpus_fingerprint(files),
    }
    save_target(model, tokenizer, out_dir, info)
    log.info("demo target saved to %s: %s", out_dir, info)
    return info


# ---------------------------------------------------------------- CLI (wired as `demo-target`)


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-eval demo-target`."""
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--tokenizer", type=Path, required=True, help="demo tokenizer directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where to train: cpu, cuda or cuda:N (demo.build_device)")


def run_target(args: argparse.Namespace) -> int:
    """Train and save the demo target; the output directory is replaced only on success."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bind_backend("torch", args.device)  # the torch kernels on any device: never fla's Triton kernels
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    info = build_target(args.tokenizer, tmp, seed=args.seed, steps=args.steps, threads=args.threads, device=args.device)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"demo target -> {out} (loss {info['loss_first']:.2f} -> {info['loss_last_10']:.2f}, {info['seconds']})")
    return 0
