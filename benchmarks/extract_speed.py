"""Hidden-state extraction speed against a plain forward, side by side, on a Qwen3.6-27B-shaped target.

Random bf16 weights (64 layers, hidden 5120, 3 Gated DeltaNet : 1 full attention, 24 heads / 4 KV
heads of 256, linear heads 16 key / 48 value of 128, intermediate 17408, vocab 248320), layers
[1,16,31,46,61], one sequence per forward. Rows, each over the same random token sequences:

- plain forward: `model(ids)` with logits for every position (what the peer measured);
- plain capture: `output_hidden_states=True`, five layers copied to the host with `.cpu()`;
- extract (ours): the extract stage's own loop (`extract._run_records`): hooks, argmax, pinned
  double-buffered shards, background writer and sha256, safetensors on local disk, everything
  included (pinned-buffer allocation, the last shard's write);
- extract, no argmax: the same without the argmax (the forward stops after layer 61);
- extract, sustained: the same run minus the final `finish` (last shard's write and hash, manifest),
  which no forward is left to overlap; it is paid once per cache, so it is ~0 on a real dataset;
- ablations, to show what each lever is worth: the forward with hooks and argmax alone (nothing
  copied or written), ours with the host copies on the compute stream instead of a side stream,
  and ours with a synchronize after every sample (what the per-sample NaN check and the pageable
  token upload cost before they were made asynchronous);
- torch backend rows: the plain forward and our extraction with transformers' torch fallback.

Then compare-backends (fla against torch) on the same sequences. Prints tables and appends them to
benchmarks/results/extract_speed.md.

    python benchmarks/extract_speed.py --device cuda --seq-lens 2048 8192 --tokens 32768
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from record import print_and_record  # benchmarks/record.py (the script's own folder)

from dflash_eval.backends import use_backend
from dflash_eval.cache import CacheWriter
from dflash_eval.capture import capture_layers
from dflash_eval.compare_backends import compare_backends, format_table
from dflash_eval.extract import _run_records

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 16, 31, 46, 61]


def target_config(layers: int, hidden: int, vocab: int):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=17408 * hidden // 5120, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        max_position_embeddings=32768, tie_word_embeddings=False,
    )


def build_target(config, device: torch.device) -> torch.nn.Module:
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
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
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


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


@torch.inference_mode()
def capture_only(model, sequences, device) -> None:
    for ids in sequences:
        capture_layers(model, LAYERS, ids.to(device), want_argmax=True)


class ComputeStreamWriter(CacheWriter):
    """Ablation: host copies queued on the compute stream (no side stream)."""

    @property
    def _copy_stream(self) -> None:
        return None

    @_copy_stream.setter
    def _copy_stream(self, _value) -> None:
        pass


class SyncEverySample:
    """Ablation: a backend whose per-sample verify() also synchronizes, as a per-sample host read did."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def verify(self):
        torch.cuda.synchronize()
        return self.backend.verify()


def our_extract(model, sequences, device, backend, store_argmax: bool, workdir: Path, shard_tokens: int,
                writer_class=CacheWriter, tail: dict | None = None) -> None:
    """The extract stage's loop; `tail["s"]` gets the seconds of `finish` (last shard's write, manifest)."""
    records = [{"id": f"s{i}", "prompt_token_ids": ids[:16].tolist(), "completion_token_ids": ids[16:].tolist()}
               for i, ids in enumerate(sequences)]
    settings = {"layer_ids": LAYERS, "store_argmax": store_argmax, "target": {"device": str(device)}}
    out = workdir / "cache"
    header = {"target": {}, "device": str(device), "completions": {}}
    with writer_class(out, layer_ids=LAYERS, shard_tokens=shard_tokens, store_argmax=store_argmax,
                      header=header) as writer:
        _run_records(model, records, settings, backend, writer)
        sync(device)
        started = time.perf_counter()
        writer.finish(backend={})
        if tail is not None:
            tail["s"] = time.perf_counter() - started
    shutil.rmtree(out)


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
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--workdir", default=None, help="where the cache is written (local disk)")
    parser.add_argument("--record", default=str(ROOT / "benchmarks" / "results" / "extract_speed.md"))
    args = parser.parse_args()
    device = torch.device(args.device)
    config = target_config(args.layers, args.hidden, args.vocab)
    started = time.perf_counter()
    model = build_target(config, device)
    print(f"built the target in {time.perf_counter() - started:.0f} s")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extract-bench-"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    rates = host_rates(workdir, device)
    print(rates, flush=True)
    lines = [f"## {name}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, bf16, layers {LAYERS}, "
             f"shard_tokens {args.shard_tokens}, torch {torch.__version__}", "",
             rates, "", "| backend | row | seq len | tokens | tokens/s | vs plain forward |", "|---|---|---:|---:|---:|---:|"]
    comparisons = []
    for seq_len in args.seq_lens:
        generator = torch.Generator().manual_seed(seq_len)
        count = max(1, args.tokens // seq_len)
        sequences = [torch.randint(0, args.vocab, (seq_len,), generator=generator) for _ in range(count)]
        for backend_name, budget in (("fla", args.tokens), ("torch", args.torch_tokens)):
            subset = sequences[: max(1, budget // seq_len)]
            tokens = seq_len * len(subset)
            with use_backend(backend_name, device, model) as backend:
                rows = {
                    "plain forward": lambda: plain_forward(model, subset, device),
                    "plain capture (.cpu())": lambda: plain_capture(model, subset, device),
                    "extract (ours)": lambda: our_extract(model, subset, device, backend, True, workdir, args.shard_tokens,
                                                          tail=tail),
                    "extract, no argmax (ours)": lambda: our_extract(model, subset, device, backend, False, workdir, args.shard_tokens),
                    "ablation: forward + hooks + argmax only": lambda: capture_only(model, subset, device),
                    "ablation: ours, copies on the compute stream": lambda: our_extract(
                        model, subset, device, backend, True, workdir, args.shard_tokens, ComputeStreamWriter),
                    "ablation: ours, a synchronize per sample": lambda: our_extract(
                        model, subset, device, SyncEverySample(backend), True, workdir, args.shard_tokens),
                }
                if device.type != "cuda":
                    rows = {k: v for k, v in rows.items() if not k.startswith("ablation: ours")}
                if backend_name == "torch":
                    rows = {k: rows[k] for k in ("plain forward", "extract (ours)")}
                plain_forward(model, subset[:1], device)  # warm-up: kernel autotuning, allocator
                # Warm-up of ours: the pinned shard buffers come from torch's host allocator cache in every
                # timed row, as they would after the first shard of a long run.
                our_extract(model, subset[:1], device, backend, True, workdir, args.shard_tokens)
                tail: dict = {}
                seconds = {label: timed(fn, device) for label, fn in rows.items()}
                backend.verify()
                # What a long run sustains: the last shard's write and the manifest happen once per cache,
                # after the last forward, so they weigh 1 / (number of shards) here and ~0 on a real dataset.
                seconds["extract (ours), sustained (without the final shard's write)"] = (
                    seconds["extract (ours)"] - tail["s"])
            base = tokens / seconds["plain forward"]
            for label, s in seconds.items():
                rate = tokens / s
                lines.append(f"| {backend_name} | {label} | {seq_len} | {tokens} | {rate:,.0f} | {rate / base:.2f}x |")
                print(lines[-1], flush=True)
        if device.type == "cuda":
            result = compare_backends(model, sequences[:2], LAYERS, device, ("fla", "torch"))
            comparisons.append(f"### compare-backends, {seq_len}-token sequences\n\n{format_table(result)}\n")
    shutil.rmtree(workdir, ignore_errors=True)
    print_and_record(lines + [""] + comparisons, Path(args.record))


if __name__ == "__main__":
    main()
