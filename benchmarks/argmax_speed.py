"""What storing the target's argmax costs beyond the lm_head product, on a Qwen3.6-27B-shaped head.

Times, with CUDA events over 20 calls each: the lm_head product alone (what the plain forward does
for its logits), the argmax of ready logits, the two together, and `capture.greedy_tokens` (the
extract stage's chunked version), for 2048 and 8192 positions; checks that the chunked argmax
equals the argmax of one product. Prints a table and appends it to benchmarks/results/argmax_speed.md.

    python benchmarks/argmax_speed.py --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from record import (  # benchmarks/record.py (the script's own folder)
    print_and_record,
    smoke_mode,
)

from dflash_eval.extract.capture import ARGMAX_CHUNK, greedy_tokens

ROOT = Path(__file__).resolve().parents[1]


def milliseconds(fn, device: torch.device, calls: int = 20) -> float:
    """Mean milliseconds of `fn` over `calls` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) * 1000 / calls
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / calls


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--positions", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--record", default=str(ROOT / "benchmarks" / "results" / "argmax_speed.md"))
    smoke_mode(parser, device="cpu", hidden=32, vocab=300, positions=[64], record=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"## {name}, lm_head {args.hidden} x {args.vocab}, {str(dtype).removeprefix('torch.')}, "
        f"ARGMAX_CHUNK {ARGMAX_CHUNK}, torch {torch.__version__}",
        "",
        "| positions | lm_head | argmax of the logits | lm_head + argmax | greedy_tokens (chunked) | "
        "chunked equals one product |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for positions in args.positions:
        hidden = torch.randn(positions, args.hidden, device=device, dtype=dtype)
        logits = head(hidden)
        times = [
            milliseconds(lambda: head(hidden), device),
            milliseconds(lambda logits=logits: logits.argmax(-1), device),
            milliseconds(lambda: head(hidden).argmax(-1), device),
            milliseconds(lambda: greedy_tokens(head, hidden), device),
        ]
        same = bool(torch.equal(greedy_tokens(head, hidden), logits.argmax(-1)))
        lines.append(f"| {positions} | " + " | ".join(f"{t:.2f} ms" for t in times) + f" | {same} |")
        print(lines[-1], flush=True)
        del logits
    print_and_record(lines + [""], args.record and Path(args.record))


if __name__ == "__main__":
    main()
