"""Train the demo's DFlash drafters on the demo target's own hidden states and greedy outputs.

The drafters are `dflash.DFlashDraftModel`s (the reference architecture), trained the way DFlash
drafters are: for random anchors s in the target's greedy completions, the block [x_s, mask...]
must predict x_{s+1..s+B-1} while attending to the projected target features of positions < s.
We train through `BlockDrafter`, the same all-anchor forward the evaluator uses, which is itself
tested against the reference model's forward. Checkpoints are saved in both layouts users have:
a Hugging Face directory (config.json + model.safetensors, the z-lab layout) and a training
checkpoint (`.pt` with `model_state_dict`, `global_step`, `epoch`), plus the untrained start.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from dflash_eval.demo.build_device import prepare_build_device
from dflash_eval.demo.corpus import chat_examples, select_sources
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.extract.backends import bind_backend
from dflash_eval.io_utils import atomic_write_json

log = logging.getLogger(__name__)

BLOCK_SIZE = 8
DRAFT_LAYERS = 2


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default layer ids: round(1 + i * (N - 4) / (n - 1)), e.g. [1, 16, 31, 46, 61] for N=64, n=5."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def drafter_config(
    target_config, mask_token_id: int, layer_ids: list[int], block_size: int = BLOCK_SIZE, window: int = 64
) -> Qwen3Config:
    """A small drafter shaped like the z-lab ones: sliding-window layers, then one full-attention layer."""
    return Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=2 * target_config.hidden_size,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=target_config.hidden_size // 4,
        max_position_embeddings=4096,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=10000.0,
        layer_types=["sliding_attention"] * (DRAFT_LAYERS - 1) + ["full_attention"],
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
        tie_word_embeddings=False,
        dtype="float32",
    )


@dataclass
class TrainingSequence:
    tokens: torch.Tensor  # [T] prompt + greedy completion
    features: torch.Tensor  # [T, n_layers * H]
    prompt_len: int


def training_prompts(tokenizer, count: int, seed: int) -> list[torch.Tensor]:
    """The prompts of the drafters' training sequences: stdlib-derived, never the evaluation prompts."""
    examples = chat_examples(select_sources(seed=seed + 101, max_bytes=400_000), seed=seed + 101)
    prompts = []
    for _ in range(count):
        text = tokenizer.apply_chat_template(next(examples)[:1], add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, -192:])
    return prompts


@torch.inference_mode()
def greedy_sequence(
    target, prompt: torch.Tensor, layer_ids: list[int], max_new_tokens: int, eos: int
) -> TrainingSequence:
    """One prompt's greedy completion and the target's features along it (batch 1: no padding), on the target's
    device."""
    prompt = prompt.to(target.device)
    tokens = target.generate(
        prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0]
    hidden = target(tokens[None], output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1)
    return TrainingSequence(tokens=tokens, features=features, prompt_len=prompt.shape[1])


_worker_target = None


def _load_worker_target(target_dir: str, threads: int, device: str) -> None:
    """A worker process's own copy of the target, with the build's thread count (it decides the bits on the CPU)
    and on the build's device (made deterministic there as in the parent)."""
    global _worker_target
    torch.set_num_threads(threads)
    torch_device = prepare_build_device(device)
    bind_backend("torch", device)
    _worker_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(torch_device)


def _worker_sequence(args: tuple[torch.Tensor, list[int], int, int]) -> TrainingSequence:
    sequence = greedy_sequence(_worker_target, *args)
    return TrainingSequence(sequence.tokens.cpu(), sequence.features.cpu(), sequence.prompt_len)  # pickled


def greedy_sequences(
    target,
    target_dir: Path,
    tokenizer,
    layer_ids: list[int],
    count: int,
    max_new_tokens: int,
    seed: int,
    workers: int = 1,
) -> list[TrainingSequence]:
    """The target's own greedy completions of the training prompts, in `workers` processes, on the CPU or on the
    target's GPU (processes side by side on it), each sequence on the target's device.

    Each sequence is computed alone (batch 1) with the same thread count and kernels in every process, so the
    result is bit-identical whatever `workers` is (tests/demo/test_drafter_build.py, and on a GPU
    tests/workflow/test_gpu_demo_build.py); more workers only keep more cores, or the GPU, busy.
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    jobs = [(prompt, layer_ids, max_new_tokens, eos) for prompt in training_prompts(tokenizer, count, seed)]
    progress = dict(total=count, desc="target greedy completions", unit="seq")
    if workers <= 1:
        return [greedy_sequence(target, *job) for job in tqdm(jobs, **progress)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_load_worker_target,
        initargs=(str(target_dir), torch.get_num_threads(), str(target.device)),
    ) as pool:
        done = list(tqdm(pool.map(_worker_sequence, jobs), **progress))
    return [TrainingSequence(s.tokens.to(target.device), s.features.to(target.device), s.prompt_len) for s in done]


def block_loss(
    runner: BlockDrafter, sequence: TrainingSequence, anchors_per_seq: int, rng: random.Random, decay: float
) -> torch.Tensor:
    """Cross-entropy of the block's predictions against the next tokens, early positions weighted more."""
    last = len(sequence.tokens) - 2
    device = sequence.tokens.device
    if last < sequence.prompt_len:
        return torch.zeros((), requires_grad=True, device=device)
    candidates = list(range(sequence.prompt_len, last + 1))
    anchors = torch.tensor(sorted(rng.sample(candidates, min(anchors_per_seq, len(candidates)))), device=device)
    context = runner.context(sequence.features)
    logits = runner.logits(runner.block_hidden(context, sequence.tokens, anchors))  # [m, B-1, V]
    offsets = torch.arange(1, runner.block_size, device=device)
    positions = anchors[:, None] + offsets[None]
    valid = positions < len(sequence.tokens)
    labels = sequence.tokens[positions.clamp(max=len(sequence.tokens) - 1)].masked_fill(~valid, -100)
    weights = torch.exp(-(offsets - 1).float() / decay)[None].expand_as(labels)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    mask = valid.reshape(-1).float() * weights.reshape(-1)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def save_checkpoint(model, out_dir: Path, name: str, step: int, epoch: float) -> None:
    """Both layouts: HF directory `<name>/` and training checkpoint `checkpoints/step_<N>.pt`."""
    model.save_pretrained(out_dir / name, safe_serialization=True)
    config_file = out_dir / name / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("auto_map", None)
    atomic_write_json(config_file, config)
    pt_dir = out_dir / "checkpoints"
    pt_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # loads anywhere
    torch.save({"model_state_dict": state, "global_step": step, "epoch": epoch}, pt_dir / f"step_{step}.pt")


def build_drafters(
    target_dir: Path,
    out_dir: Path,
    steps: list[int],
    seed: int = 0,
    sequences: int = 48,
    max_new_tokens: int = 128,
    anchors_per_seq: int = 32,
    lr: float = 2e-3,
    workers: int = 1,
    device: str = "cpu",
) -> dict:
    """Train one drafter on `device`, saving the untrained start and a checkpoint at each of `steps`.

    The drafter starts from the same seeded CPU initialisation on every device; `workers` processes compute the
    training completions, on the build's device."""
    torch_device = prepare_build_device(device)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(torch_device)
    for param in target.parameters():
        param.requires_grad_(False)
    config = target.config
    layer_ids = default_layer_ids(config.num_hidden_layers, DRAFT_LAYERS)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    data = greedy_sequences(target, target_dir, tokenizer, layer_ids, sequences, max_new_tokens, seed, workers)
    data = [TrainingSequence(s.tokens.clone(), s.features.clone(), s.prompt_len) for s in data]
    from dflash import DFlashDraftModel

    model = DFlashDraftModel(drafter_config(config, mask_id, layer_ids)).to(torch_device)
    runner = BlockDrafter(
        model, target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach(), mask_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out_dir, "untrained", 0, 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = max(steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total))
    )
    model.train()
    losses: list[float] = []
    progress = tqdm(range(1, total + 1), desc="train demo drafter", unit="step")
    for step in progress:
        sequence = data[rng.randrange(len(data))]
        loss = block_loss(runner, sequence, anchors_per_seq, rng, decay=4.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss))
        if step % 20 == 0:
            progress.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
        if step in steps:
            model.eval()
            save_checkpoint(model, out_dir, f"step{step}", step, step / len(data))
            model.train()
    info = {
        "layer_ids": layer_ids,
        "block_size": BLOCK_SIZE,
        "mask_token_id": mask_id,
        "steps": sorted(steps),
        "sequences": len(data),
        "seed": seed,
        "device": device,
        "final_loss": sum(losses[-20:]) / min(20, len(losses)),
        "seconds": round(time.perf_counter() - started, 1),
    }
    atomic_write_json(out_dir / "build_info.json", info)
    log.info("demo drafters -> %s (%s)", out_dir, info)
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, required=True, help="demo target directory")
    parser.add_argument("--out", type=Path, required=True, help="output directory for all drafters")
    parser.add_argument("--steps", type=int, nargs="+", required=True, help="training steps to save")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads per process (decides the bits)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes for the target's greedy completions, on the build's device (same result for any number)",
    )
    parser.add_argument("--device", default="cpu", help="where to train: cpu, cuda or cuda:N (demo.build_device)")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    bind_backend("torch", args.device)  # the target's features come from its torch kernels, on any device
    build_drafters(
        args.target,
        args.out,
        args.steps,
        seed=args.seed,
        sequences=args.sequences,
        workers=args.workers,
        device=args.device,
    )
    return 0
