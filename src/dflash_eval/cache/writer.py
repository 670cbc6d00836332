"""The hidden-state cache, written: shards filled from the target's states and published atomically.

The writer fills `<out>.tmp-<pid>/` (or `<out>.partial/` when it resumes) and renames it to `<out>` only when
complete, so a reader (cache.store) never sees a partial cache. The layout is cache.store's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.manifest import CacheError
from dflash_eval.cache.resume import (
    JOURNAL,
    PLAN,
    ResumeState,
    append_journal,
    partial_dir,
)
from dflash_eval.cache.store import LOGPROB_KEY, layer_key, shard_name

__all__ = ["CacheError", "CacheWriter"]

log = logging.getLogger(__name__)

WRITER_THREADS = 2  # shards written at once; one thread falls behind a fast GPU (benchmarks/results/extract_speed.md)


_SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Write contiguous CPU tensors as one safetensors file; return (sha256, bytes).

    Written here from the format (u64 header length, JSON header, raw little-endian data) so
    that the bytes go straight from the pinned shard buffer to the file and the hash in one pass,
    with no intermediate copies (the safetensors package copies each tensor to `bytes` first).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    # Hashing and writing each chunk run side by side (both release the GIL): a shard then costs
    # max(hash, write) instead of their sum, which decides whether the GPU ever waits for the disk.
    with open(path, "wb") as handle, ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        for chunk in (
            len(encoded).to_bytes(8, "little"),
            encoded,
            *(t.contiguous().view(torch.uint8).numpy().data for t in tensors.values()),
        ):
            hashed = hasher.submit(digest.update, chunk)
            handle.write(chunk)
            hashed.result()
    return digest.hexdigest(), 8 + len(encoded) + offset


class _ShardBuffer:
    """Preallocated host rows for one shard; pinned when the states come from a GPU."""

    def __init__(
        self,
        layer_ids: Sequence[int],
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        store_argmax: bool,
        pin: bool,
        store_logprob: bool = False,
    ) -> None:
        def rows(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, pin_memory=pin)

        self.layers = {i: rows(capacity, hidden, dtype=dtype) for i in layer_ids}
        self.input_ids = rows(capacity)
        self.argmax = rows(capacity) if store_argmax else None
        self.logprob = rows(capacity, dtype=torch.float32) if store_logprob else None
        self.capacity = capacity
        self.tokens = 0
        self.write: Future | None = None  # the pending write that reads this buffer

    def put(
        self,
        input_ids: torch.Tensor,
        states: dict[int, torch.Tensor],
        argmax: torch.Tensor | None,
        stream: torch.cuda.Stream | None = None,
        logprob: torch.Tensor | None = None,
    ) -> None:
        """Copy one sample in; from a GPU asynchronously, on `stream` (wait for it before reading the rows).

        On a side stream the copies overlap the next forward instead of queueing behind it; the
        sources are marked as used there so the allocator does not hand their memory out too early.
        """
        rows = slice(self.tokens, self.tokens + input_ids.numel())
        pairs = [(rows_of_layer[rows], states[layer_id]) for layer_id, rows_of_layer in self.layers.items()]
        pairs.append((self.input_ids[rows], input_ids))
        if self.argmax is not None:
            pairs.append((self.argmax[rows], argmax))
        if self.logprob is not None:
            pairs.append((self.logprob[rows], logprob))
        if stream is None:
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
        else:
            stream.wait_stream(torch.cuda.current_stream(input_ids.device))
            with torch.cuda.stream(stream):
                for destination, source in pairs:
                    destination.copy_(source, non_blocking=True)
                    source.record_stream(stream)
        self.tokens = rows.stop

    def filled(self) -> dict[str, torch.Tensor]:
        """The shard's tensors: views of the filled rows."""
        tensors = {layer_key(i): rows[: self.tokens] for i, rows in self.layers.items()}
        tensors["input_ids"] = self.input_ids[: self.tokens]
        if self.argmax is not None:
            tensors["argmax"] = self.argmax[: self.tokens]
        if self.logprob is not None:
            tensors[LOGPROB_KEY] = self.logprob[: self.tokens]
        return tensors

    def wait(self) -> None:
        """Block until no pending write reads this buffer, then mark it empty."""
        if self.write is not None:
            self.write.result()
            self.write = None
        self.tokens = 0


@dataclass
class _PendingCopies:
    """What a shard's writer must wait for and check before it may read a buffer filled from a GPU.

    `ready` is recorded on the copy stream after the shard's last copy; `finite` [samples, layers]
    arrives in pinned memory through the same stream. The main thread never waits for them: a
    device-wide synchronize per shard would drain the GPU's queue at every shard boundary.
    """

    ready: torch.cuda.Event
    finite: torch.Tensor
    layer_ids: list[int]

    def check(self, samples: Sequence[dict[str, Any]], layers: dict[int, torch.Tensor]) -> None:
        """Block until the copies landed; raise for the first sample with a NaN/Inf state."""
        self.ready.synchronize()
        if bool(self.finite.all()):
            return
        row, column = (~self.finite).nonzero()[0].tolist()
        sample, layer_id = samples[row], self.layer_ids[column]
        raise _nonfinite_error(
            sample["id"], layer_id, layers[layer_id][sample["offset"] : sample["offset"] + sample["length"]]
        )


def _write_shard(
    path: Path,
    buffer: _ShardBuffer,
    journal: Path | None = None,
    index: int = 0,
    samples: Sequence[dict[str, Any]] = (),
    pending: _PendingCopies | None = None,
) -> dict[str, Any]:
    """Check, save and hash one shard, then journal it; runs on a writer thread.

    A shard with a non-finite state raises before its file is opened, so it never reaches disk.
    """
    if pending is not None:
        pending.check(samples, buffer.layers)
    tensors = buffer.filled()
    path.unlink(missing_ok=True)  # a new inode: the old file may be hard-linked from <out>.kept/ (cache.reuse)
    sha256, size = write_safetensors(path, tensors, {"format": "pt"})
    entry = {"file": path.name, "sha256": sha256, "bytes": size, "tokens": int(tensors["input_ids"].numel())}
    if journal is not None:  # written after the file, checked against it on resume (no fsync needed)
        append_journal(journal, {**entry, "index": index, "samples": list(samples)})
    return entry


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, quota exceeded


def _gib(size: float) -> str:
    """A size for a person: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def _done(value: dict[str, Any]) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _nonfinite_error(sample_id: str, layer_id: int, state: torch.Tensor) -> CacheError:
    bad = (~torch.isfinite(state)).nonzero()
    return CacheError(
        f"sample {sample_id!r}, layer {layer_id}: {len(bad)} non-finite values (NaN/Inf), first at token "
        f"{int(bad[0, 0])}; the target forward is broken (dtype overflow, bad weights); the shard holding it was not written"
    )


class CacheWriter:
    """Accumulates samples into shards of at most `shard_tokens` tokens and publishes the directory.

    Three preallocated shard buffers rotate: one fills (asynchronous GPU->pinned copies, on a side
    stream) while two background threads check, write and hash the others, so host memory stays at
    three shards (plus one one-off buffer) and the GPU waits for the disk only when the disk is slower
    than the forward. A sample never spans shards; one longer than `shard_tokens` gets a shard of its
    own, from a one-off buffer that waits for the previous one-off's write, and
    `close_shard` ends a shard early where the plan says (cache.resume.plan_shards states the
    rule). Use as a context manager: an
    exception removes the temporary directory, unless the writer resumes (`resume` given): then
    it works in `<out>.partial/`, journals every finished shard, and leaves them for the next run.
    """

    write_shard = staticmethod(_write_shard)  # what a writer thread runs per shard (benchmarks swap it)

    def __init__(
        self,
        out: str | Path,
        *,
        layer_ids: Sequence[int],
        shard_tokens: int,
        store_argmax: bool,
        header: dict[str, Any],
        resume: ResumeState | None = None,
        store_logprob: bool = False,
    ) -> None:
        if shard_tokens < 1:
            raise CacheError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.out = Path(out)
        self.resume = resume
        self.tmp = partial_dir(self.out) if resume else self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")
        self.layer_ids = list(layer_ids)
        self.shard_tokens = shard_tokens
        self.store_argmax = store_argmax
        self.store_logprob = store_logprob
        self.header = dict(header)
        self.samples: list[dict[str, Any]] = []
        self._ids: set[str] = set()
        self._shards: list[Future] = []
        self._buffers: list[_ShardBuffer] = []  # [filling, *spares oldest first], allocated at the first sample
        self._oversize: _ShardBuffer | None = None  # the latest one-off buffer of a sample longer than shard_tokens
        self._copy_stream: torch.cuda.Stream | None = None  # GPU->host copies, beside the forward
        self._pending_finite: list[torch.Tensor] = []  # GPU finite flags of the unsubmitted samples
        self._hidden: tuple[int, torch.dtype] | None = None
        self.adopted = 0  # shards taken over from an earlier run
        self._unsubmitted = 0  # index in self.samples of the first sample of the shard being filled
        self.writer_wait_s = 0.0  # time `add` blocked on a writer: the GPU waited for the disk
        self.tail_s = 0.0  # time `finish` waited for the last shards, after the last forward
        self._pool = ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="cache-writer")
        if resume is None and self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()

    def _check(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        states: dict[int, torch.Tensor],
        argmax: torch.Tensor | None,
        prompt_len: int,
        logprob: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Reject a sample whose shapes or keys do not fit the cache; its finite flags per layer.

        CPU states are checked for NaN/Inf here; GPU flags are returned unread (see `add`).
        """
        if sample_id in self._ids:
            raise CacheError(f"sample id {sample_id!r} appears twice")
        length = input_ids.numel()
        if length == 0 or not 0 <= prompt_len <= length:
            raise CacheError(f"sample {sample_id!r}: {length} tokens with prompt_len {prompt_len}")
        if sorted(states) != sorted(self.layer_ids):
            raise CacheError(f"sample {sample_id!r}: layers {sorted(states)} given, cache holds {self.layer_ids}")
        if (argmax is not None) != self.store_argmax:
            raise CacheError(
                f"sample {sample_id!r}: argmax {'missing' if argmax is None else 'given'} "
                f"but store_argmax={self.store_argmax}"
            )
        if argmax is not None and argmax.shape != (length,):
            raise CacheError(f"sample {sample_id!r}: argmax shape {tuple(argmax.shape)}, expected ({length},)")
        if (logprob is not None) != self.store_logprob or (logprob is not None and logprob.shape != (length,)):
            raise CacheError(
                f"sample {sample_id!r}: target log-probs {'missing' if logprob is None else tuple(logprob.shape)}"
                f", expected ({length},) when store_logprob (here {self.store_logprob}), else none"
            )
        for layer_id, state in states.items():
            hidden = (state.shape[-1], state.dtype)
            if state.dim() != 2 or state.shape[0] != length or self._hidden not in (None, hidden):
                raise CacheError(
                    f"sample {sample_id!r}, layer {layer_id}: state {tuple(state.shape)} {state.dtype}, "
                    f"expected ({length}, H) with one H and dtype for the whole cache"
                )
            self._hidden = hidden
        finite = torch.stack([torch.isfinite(states[i]).all() for i in self.layer_ids])
        if not finite.is_cuda:  # reading a GPU flag now would stall the queue; see _pending_copies
            for layer_id, ok in zip(self.layer_ids, finite.tolist()):
                if not ok:
                    raise _nonfinite_error(sample_id, layer_id, states[layer_id])
        return finite

    def _pending_copies(self) -> _PendingCopies | None:
        """The event and finite flags the writer of the shard being submitted waits for (GPU only).

        GPU samples are checked on the writer thread rather than in `add`: a host read per sample
        (or a synchronize per shard) would stop the CPU from queueing the next forward while the
        GPU finishes this one. A bad sample still never reaches a file: the writer checks first.
        """
        pending, self._pending_finite = self._pending_finite, []
        if not pending:
            return None
        stream = self._copy_stream
        with torch.cuda.stream(stream):  # it already waited for the forwards that computed the flags
            for flags in pending:
                flags.record_stream(stream)
            finite = torch.empty(len(pending), len(self.layer_ids), dtype=torch.bool, pin_memory=True)
            finite.copy_(torch.stack(pending), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return _PendingCopies(ready, finite, self.layer_ids)

    def _new_buffer(self, capacity: int, pin: bool) -> _ShardBuffer:
        hidden, dtype = self._hidden
        return _ShardBuffer(self.layer_ids, capacity, hidden, dtype, self.store_argmax, pin, self.store_logprob)

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        states: dict[int, torch.Tensor],
        argmax: torch.Tensor | None,
        prompt_len: int,
        logprob: torch.Tensor | None = None,
    ) -> None:
        """Copy one sample's tokens, layer states [T, H], argmax [T] and target log-probs [T] into the shard buffer."""
        input_ids = input_ids.reshape(-1)
        finite = self._check(sample_id, input_ids, states, argmax, prompt_len, logprob)
        length = input_ids.numel()
        pin = torch.cuda.is_available() and states[self.layer_ids[0]].is_cuda
        if not self._buffers:
            self._buffers = [self._new_buffer(self.shard_tokens, pin) for _ in range(WRITER_THREADS + 1)]
            self._copy_stream = torch.cuda.Stream(states[self.layer_ids[0]].device) if pin else None
        if length > self.shard_tokens:  # its own shard, from a one-off buffer, one at a time (host memory bound)
            self._flush()
            if self._oversize is not None:
                self._wait_for(self._oversize)
            buffer = self._oversize = self._new_buffer(length, pin=False)
        else:
            buffer = self._buffers[0]
            if buffer.tokens + length > self.shard_tokens:
                self._flush()
                buffer = self._buffers[0]
        offset = buffer.tokens
        buffer.put(input_ids, states, argmax, self._copy_stream if finite.is_cuda else None, logprob)
        self.samples.append(
            {
                "id": sample_id,
                "shard": shard_name(len(self._shards)),
                "offset": offset,
                "length": length,
                "prompt_len": int(prompt_len),
            }
        )
        self._ids.add(sample_id)
        if finite.is_cuda:
            self._pending_finite.append(finite)
        if buffer is not self._buffers[0]:
            self._submit(buffer)
        elif buffer.tokens == self.shard_tokens:
            self._flush()

    def adopt(self, index: int, entry: dict[str, Any]) -> None:
        """Take over shard `index`, finished and verified by an earlier run (see cache.resume)."""
        self.close_shard()
        if index != len(self._shards):
            raise CacheError(f"shard {index} adopted out of order (next is {len(self._shards)})")
        for sample in entry["samples"]:
            if sample["id"] in self._ids:
                raise CacheError(f"sample id {sample['id']!r} appears twice")
            self._ids.add(sample["id"])
            self.samples.append(dict(sample))
        self._shards.append(_done({key: entry[key] for key in ("file", "sha256", "bytes", "tokens")}))
        self._unsubmitted = len(self.samples)
        self.adopted += 1

    def _submit(self, buffer: _ShardBuffer) -> None:
        """Queue `buffer` for a writer thread, which waits for its asynchronous copies to land."""
        index = len(self._shards)
        path = self.tmp / shard_name(index)
        journal = self.tmp / JOURNAL if self.resume else None
        samples = self.samples[self._unsubmitted :]
        self._unsubmitted = len(self.samples)
        buffer.write = self._pool.submit(
            self._write_or_explain, path, buffer, journal, index, samples, self._pending_copies()
        )
        self._shards.append(buffer.write)

    def _write_or_explain(self, path: Path, buffer: _ShardBuffer, *args: Any) -> dict[str, Any]:
        """write_shard, a full disk said as which path filled, what the cache still needs and what a rerun keeps."""
        try:
            return self.write_shard(path, buffer, *args)
        except OSError as error:
            if error.errno not in DISK_FULL:
                raise
            shard = sum(t.numel() * t.element_size() for t in buffer.filled().values())
            index = int(args[1]) if len(args) > 1 else len(self._shards) - 1
            raise CacheError(self.disk_full(path, error, shard, index)) from None

    def disk_full(self, path: Path, error: OSError, shard_bytes: int, index: int) -> str:
        """What a full disk at shard `index` means: the path, the space the rest of the cache needs, the rerun."""
        free = shutil.disk_usage(path.parent).free
        if not shard_bytes:
            need = "only the manifest (a few KiB) is left to write"
            rerun = "a rerun resumes from the shards written" if self.resume else "a rerun starts this cache again"
        elif self.resume is not None:
            left = len([i for i in self.resume.todo if i >= index])
            need = (
                f"this cache needs about {_gib(left * shard_bytes)} more ({left} shard(s) of about "
                f"{_gib(shard_bytes)} still to write, this one included)"
            )
            rerun = f"a rerun resumes from the shards already journaled in {self.tmp} (kept) and writes only the rest"
        else:
            need = f"this shard needs {_gib(shard_bytes)}"
            rerun = "a rerun starts this cache again"
        return (
            f"{path}: the disk is full ({error.strerror}): {_gib(free)} free there, and {need}. Free that space "
            f"(or give results/hidden a larger disk) and rerun; {rerun}. Nothing published before is touched."
        )

    def close_shard(self) -> None:
        """End the shard being filled here, as the plan says (cache.resume.plan_shards); no-op when empty."""
        if self._buffers:
            self._flush()

    def _flush(self) -> None:
        """Write the filling buffer and continue in the oldest spare (after its own write is done)."""
        filling, spare, *others = self._buffers
        if not filling.tokens:
            return
        self._submit(filling)
        self._wait_for(spare)  # surfaces write errors early and bounds host memory to WRITER_THREADS + 1 shards
        self._buffers = [spare, *others, filling]

    def _wait_for(self, buffer: _ShardBuffer) -> None:
        """Block until no write reads `buffer`, counting the time as the forward waiting for the disk."""
        started = time.perf_counter()
        buffer.wait()
        self.writer_wait_s += time.perf_counter() - started

    def finish(self, **updates: Any) -> Path:
        """Write the last shard and the manifest, then atomically publish `<out>` (replacing an old one)."""
        started = time.perf_counter()
        self.close_shard()
        shards = [future.result() for future in self._shards]
        self._pool.shutdown()
        self.tail_s = time.perf_counter() - started
        self._buffers, self._oversize = [], None
        for shard in shards:  # what `snakemake -n` compares with later (cache.verify.changed_since_extraction)
            shard["mtime_ns"] = (self.tmp / shard["file"]).stat().st_mtime_ns
        manifest = cache_manifest.build(
            {**self.header, **updates}, self.layer_ids, self.store_argmax, self.samples, shards
        )
        if self.resume:
            manifest.update(plan_key=self.resume.key, resumed_shards=self.adopted)
        try:
            cache_manifest.write(self.tmp, manifest)
        except OSError as error:
            if error.errno not in DISK_FULL:
                raise
            raise CacheError(self.disk_full(self.tmp / "manifest.json", error, 0, len(self._shards))) from None
        self._publish()
        for name in (JOURNAL, PLAN):  # bookkeeping of the partial directory, not part of the cache
            (self.out / name).unlink(missing_ok=True)
        log.info(
            "hidden cache %s: %d samples, %d tokens, %d shards; the forward waited %.1f s for the writers, "
            "and the last shards took %.1f s after it",
            self.out,
            len(self.samples),
            sum(s["tokens"] for s in shards),
            len(shards),
            self.writer_wait_s,
            self.tail_s,
        )
        return self.out

    def _publish(self) -> None:
        old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        if self.out.exists():
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old.exists():
            shutil.rmtree(old)

    def abort(self) -> None:
        """Stop writing; `<out>` (if any) is left as it was.

        A resuming writer keeps `<out>.partial/` (its journaled shards are the next run's head
        start); otherwise everything written so far is dropped.
        """
        # A resuming writer lets queued shard writes finish: they are complete shards, journaled for
        # the next run. Otherwise they are dropped with the temporary directory.
        self._pool.shutdown(wait=True, cancel_futures=self.resume is None)
        self._buffers, self._oversize = [], None
        if self.resume is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
