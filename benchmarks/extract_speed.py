"""Hidden-state extraction speed against a plain forward, side by side, on a Qwen3.6-27B-shaped target.

Random bf16 weights (64 layers, hidden 5120, 3 Gated DeltaNet : 1 full attention, 24 heads / 4 KV
heads of 256, linear heads 16 key / 48 value of 128, intermediate 17408, vocab 248320), layers
[1,16,31,46,61], one sequence per forward. Rows, each over the same random token sequences:

- plain forward: `model(ids)` with logits for every position (what the peer measured), the ids
  uploaded with `.to(device)` as a user would: that copy waits for the previous forward, so the GPU
  idles while the next forward's first kernels are queued. "ours" uploads through pinned memory
  and does not wait; the "forward + hooks + argmax only" ablation uploads like the plain forward;
- plain capture: `output_hidden_states=True`, five layers copied to the host with `.cpu()`;
- extract (ours): the extract stage's own path (`cache.resume.prepare_resume`, `extract.stage.run_records`):
  hooks, argmax, pinned shard buffers filled on a side stream, two writer threads that check the
  NaN flags, hash (sha256) and write safetensors on local disk and journal each shard (what makes
  a killed run resumable), shards planned with a halving tail; everything included
  (the last shards' write after the last forward);
- extract, no argmax: the same without the argmax (the forward stops after layer 61);
- extract, sustained: the same run minus what `finish` waited for after the last forward;
- ablations, to show what each lever is worth: the forward with hooks and argmax alone (nothing
  copied or written), ours with greedy shards (no halving tail: the last full shard is written
  after the last forward), ours with a device-wide synchronize at every shard boundary (how the
  NaN flags were read before the writer threads took that over), ours without the journal
  (not resumable), ours with writer threads that only wait for the copies and check the NaN flags
  (no hash, no file: what the copies alone cost), and the plain forward beside a thread that
  hashes 1 MB chunks in a loop (whether host load alone slows the forward);
- torch backend rows: the plain forward and our extraction with transformers' torch fallback.

The cache each "ours" row wrote is deleted after its clock stops: the stage never deletes its
output, and unlinking gigabytes of page cache is not extraction. Each "ours" row also gives how
long the forward waited for the writers in total and how long `finish` waited after the last
forward.

Then compare-backends (fla against torch) on the same sequences. Prints tables and appends them to
benchmarks/results/extract_speed.md.

    python benchmarks/extract_speed.py --device cuda --seq-lens 2048 8192 --tokens 131072 --repeats 3

A short run (one repeat of 65k tokens) moved rows by about +-0.03x between repeats of the same work;
--repeats N rotates the rows' order N times and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.cache.resume import greedy_shards, plan_shards, prepare_resume
from dflash_eval.cache.writer import CacheWriter
from dflash_eval.demo.drafters import default_layer_ids
from dflash_eval.extract.backends import use_backend
from dflash_eval.extract.capture import capture_layers
from dflash_eval.extract.stage import run_records
from dflash_eval.tools.compare_backends import compare_backends, format_table

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 16, 31, 46, 61]  # the default layer ids of 5 drafter layers on 64 (main sets them for --layers)


def target_config(layers: int, hidden: int, vocab: int):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=17408 * hidden // 5120,
        num_hidden_layers=layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )


def build_target(config, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Random weights in `dtype` (bf16 as a served target; --smoke's float32 because bf16 matmuls on a CPU without
    bf16 instructions are emulated, minutes even for the tiny shape)."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds of `fn()`; a directory it returns is deleted after the clock stops."""
    sync(device)
    started = time.perf_counter()
    made = fn()
    sync(device)
    seconds = time.perf_counter() - started
    if isinstance(made, Path):
        shutil.rmtree(made)
    return seconds


@torch.inference_mode()
def plain_forward(model, sequences, device) -> None:
    for ids in sequences:
        model(ids[None].to(device), use_cache=False)


@torch.inference_mode()
def plain_capture(model, sequences, device) -> None:
    for ids in sequences:
        out = model(ids[None].to(device), use_cache=False, output_hidden_states=True)
        kept = [out.hidden_states[i + 1][0].cpu() for i in LAYERS]
        del out, kept


def busy_forward(model, sequences, device) -> None:
    with busy_host_thread():
        plain_forward(model, sequences, device)


@torch.inference_mode()
def capture_only(model, sequences, device) -> None:
    for ids in sequences:
        capture_layers(model, LAYERS, ids.to(device), want_argmax=True, last_layer="final_norm")


def checks_only(path: Path, buffer, journal, index, samples, pending) -> dict:
    """Ablation writer thread: waits for the copies and checks the NaN flags, hashes nothing and writes an empty
    file (CacheWriter.finish reads each shard file's mtime)."""
    if pending is not None:
        pending.check(samples, buffer.layers)
    path.touch()
    return {"file": path.name, "sha256": "", "bytes": 0, "tokens": buffer.tokens}


class CopiesOnlyWriter(CacheWriter):
    """Ablation: the copies to pinned memory and the NaN checks, no file and no hash."""

    write_shard = staticmethod(checks_only)


@contextlib.contextmanager
def busy_host_thread(chunk_mb: int = 1):
    """A thread hashing 1 MB chunks in a loop (each update releases the GIL): does host load slow the forward?"""
    import hashlib

    data, stop = bytes(chunk_mb << 20), threading.Event()

    def spin() -> None:
        digest = hashlib.sha256()
        while not stop.is_set():
            digest.update(data)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class SyncPerShardWriter(CacheWriter):
    """Ablation: a device-wide synchronize before each shard is handed to a writer thread."""

    def _submit(self, buffer) -> None:
        torch.cuda.synchronize()
        super()._submit(buffer)


def our_extract(
    model,
    sequences,
    device,
    backend,
    store_argmax: bool,
    workdir: Path,
    shard_tokens: int,
    writer_class=CacheWriter,
    plan=plan_shards,
    journal: bool = True,
    stats: dict | None = None,
) -> Path:
    """The extract stage's path; `stats` gets the writer's wait and tail seconds. Returns the cache
    directory, which the caller deletes outside the timed region (the stage never deletes it, and
    unlinking ~3 GB of page cache takes a noticeable fraction of a second)."""
    records = [
        {"id": f"s{i}", "prompt_token_ids": ids[:16].tolist(), "completion_token_ids": ids[16:].tolist()}
        for i, ids in enumerate(sequences)
    ]
    settings = {
        "layer_ids": LAYERS,
        "last_layer": "final_norm",
        "store_argmax": store_argmax,
        "target": {"device": str(device)},
    }
    out = workdir / "cache"
    header = {"target": {}, "device": str(device), "completions": {}}
    shards = plan([len(ids) for ids in sequences], shard_tokens)
    resume = prepare_resume(out, "benchmark", shards, [r["id"] for r in records]) if journal else None
    with writer_class(
        out, layer_ids=LAYERS, shard_tokens=shard_tokens, store_argmax=store_argmax, header=header, resume=resume
    ) as writer:
        run_records(model, records, settings, backend, writer, resume)
        writer.finish(backend={})
    if stats is not None:
        stats.update(wait=writer.writer_wait_s, tail=writer.tail_s)
    return out


def repeated(rows: dict, device: torch.device, repeats: int, stats: dict) -> dict[str, list[float]]:
    """Seconds of each row, `repeats` times, the row order rotated each time so that no row always
    follows the same one; plus "sustained" (ours minus what `finish` waited for after the last
    forward: paid once per cache, so ~0 on a real dataset of hundreds of shards), listed last."""
    labels = list(rows)
    runs: dict[str, list[float]] = {label: [] for label in labels}
    sustained = "extract (ours), sustained (without the wait at the end)"
    for repeat in range(repeats):
        for label in labels[repeat % len(labels) :] + labels[: repeat % len(labels)]:
            runs[label].append(timed(rows[label], device))
            if label == "extract (ours)":
                runs.setdefault(sustained, []).append(runs[label][-1] - stats[label]["tail"])
    return runs


def host_rates(workdir: Path, device: torch.device, megabytes: int = 1024) -> str:
    """GB/s of what the writer threads and the copies depend on, so a slow host shows in the record."""
    import hashlib

    data = torch.randint(0, 255, (megabytes << 20,), dtype=torch.uint8)
    started = time.perf_counter()
    hashlib.sha256(data.numpy().data).hexdigest()
    rates = {"sha256": megabytes / 1024 / (time.perf_counter() - started)}
    path = workdir / "rate.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data.numpy().data)
    rates["file write (page cache)"] = megabytes / 1024 / (time.perf_counter() - started)
    path.unlink()
    if device.type == "cuda":
        source, pinned = data.to(device), torch.empty_like(data, pin_memory=True)
        pinned.copy_(source)
        sync(device)
        rates["GPU->pinned copy"] = megabytes / 1024 / timed(lambda: pinned.copy_(source, non_blocking=True), device)
    return "Host rates: " + ", ".join(f"{name} {rate:.1f} GB/s" for name, rate in rates.items()) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per row and sequence length")
    parser.add_argument("--shard-tokens", type=int, default=16384, help="extraction.shard_tokens (config default)")
    parser.add_argument("--torch-tokens", type=int, default=16384, help="tokens for the torch-backend rows")
    parser.add_argument("--backends", nargs="+", default=["fla", "torch"], help="torch alone on a CPU")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every row this many times (rotating their order); medians are reported",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="keep only the rows whose label contains one of these (plain forward always runs)",
    )
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--host-mb", type=int, default=1024, help="MB hashed and written for the host rates")
    parser.add_argument("--workdir", default=None, help="where the cache is written (local disk)")
    parser.add_argument("--record", default=str(ROOT / "benchmarks" / "results" / "extract_speed.md"))
    smoke_mode(
        parser,
        device="cpu",
        seq_lens=[32],
        tokens=64,
        shard_tokens=64,
        torch_tokens=64,
        backends=["torch"],
        layers=8,
        hidden=32,
        vocab=300,
        host_mb=8,
        dtype="float32",
        record=None,
    )
    args = parser.parse_args()
    global LAYERS
    LAYERS = default_layer_ids(args.layers, len(LAYERS))  # [1, 16, 31, 46, 61] on the 64 layers of the full run
    device = torch.device(args.device)
    config = target_config(args.layers, args.hidden, args.vocab)
    started = time.perf_counter()
    model = build_target(config, device, getattr(torch, args.dtype))
    print(f"built the target in {time.perf_counter() - started:.0f} s")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extract-bench-"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    rates = host_rates(workdir, device, args.host_mb)
    print(rates, flush=True)
    lines = [
        f"## {name}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}, layers {LAYERS}, "
        f"shard_tokens {args.shard_tokens}, torch {torch.__version__}",
        "",
        rates,
        "",
        f"| backend | row | seq len | tokens | tokens/s (median of {args.repeats}) | vs plain forward (median of "
        "the repeats' ratios, and their range) | s waited for writers / at the end (last repeat) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    comparisons = []
    for seq_len in args.seq_lens:
        generator = torch.Generator().manual_seed(seq_len)
        count = max(1, args.tokens // seq_len)
        sequences = [torch.randint(0, args.vocab, (seq_len,), generator=generator) for _ in range(count)]
        for backend_name in args.backends:
            budget = args.torch_tokens if backend_name == "torch" and "fla" in args.backends else args.tokens
            subset = sequences[: max(1, budget // seq_len)]
            tokens = seq_len * len(subset)
            with use_backend(backend_name, device, model) as backend:
                stats: dict[str, dict] = {}

                def ours(label: str, store_argmax: bool = True, **options):
                    stats[label] = {}
                    return lambda: our_extract(
                        model,
                        subset,
                        device,
                        backend,
                        store_argmax,
                        workdir,
                        args.shard_tokens,
                        stats=stats[label],
                        **options,
                    )

                rows = {
                    "plain forward": lambda: plain_forward(model, subset, device),
                    "plain capture (.cpu())": lambda: plain_capture(model, subset, device),
                    "extract (ours)": ours("extract (ours)"),
                    "extract, no argmax (ours)": ours("extract, no argmax (ours)", False),
                    "ablation: forward + hooks + argmax only": lambda: capture_only(model, subset, device),
                    "ablation: ours, copies and NaN checks only (nothing hashed or written)": ours(
                        "ablation: ours, copies and NaN checks only (nothing hashed or written)",
                        writer_class=CopiesOnlyWriter,
                    ),
                    "ablation: plain forward beside a thread hashing 1 MB chunks": lambda: busy_forward(
                        model, subset, device
                    ),
                    "ablation: ours, greedy shards (no halving tail)": ours(
                        "ablation: ours, greedy shards (no halving tail)", plan=greedy_shards
                    ),
                    "ablation: ours, a synchronize per shard": ours(
                        "ablation: ours, a synchronize per shard", writer_class=SyncPerShardWriter
                    ),
                    "ablation: ours, no journal (not resumable)": ours(
                        "ablation: ours, no journal (not resumable)", journal=False
                    ),
                }
                if device.type != "cuda":
                    rows = {k: v for k, v in rows.items() if not k.startswith("ablation: ours, a sync")}
                if args.only:
                    rows = {k: v for k, v in rows.items() if k == "plain forward" or any(o in k for o in args.only)}
                if backend_name == "torch" and "fla" in args.backends:
                    rows = {k: rows[k] for k in ("plain forward", "extract (ours)") if k in rows}
                plain_forward(model, subset[:1], device)  # warm-up: kernel autotuning, allocator
                # Warm-up of ours: the pinned shard buffers come from torch's host allocator cache in every
                # timed row, as they would after the first shard of a long run.
                shutil.rmtree(our_extract(model, subset[:1], device, backend, True, workdir, args.shard_tokens))
                runs = repeated(rows, device, args.repeats, stats)
                backend.verify()
            for label, times in runs.items():
                rate = tokens / statistics.median(times)
                # Each repeat's ratio against the plain forward of the same repeat: slow drifts of the
                # machine cancel out; the median of those is the number the goal is judged by.
                ratios = [p / t for p, t in zip(runs["plain forward"], times)]
                ratio = f"{statistics.median(ratios):.2f}x"
                if len(ratios) > 1:  # the spread shows what a difference between two rows is worth
                    ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
                waits = stats.get(label)
                waited = f"{waits['wait']:.2f} / {waits['tail']:.2f}" if waits else ""
                lines.append(f"| {backend_name} | {label} | {seq_len} | {tokens} | {rate:,.0f} | {ratio} | {waited} |")
                print(lines[-1], flush=True)
        if {"fla", "torch"} <= set(args.backends):
            result = compare_backends(model, sequences[:2], LAYERS, device, ("fla", "torch"))
            comparisons.append(f"### compare-backends, {seq_len}-token sequences\n\n{format_table(result)}\n")
    shutil.rmtree(workdir, ignore_errors=True)
    print_and_record(lines + [""] + comparisons, args.record and Path(args.record))


if __name__ == "__main__":
    main()
