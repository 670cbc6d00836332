"""The hidden-state cache, read: the shard format's tensor names and `HiddenCache`, a validated read-only view.

Layout (docs/contracts.md): `<out>/manifest.json` and `<out>/shard_NNNNN.safetensors`, each shard holding its
samples concatenated along tokens as `layer.{id}` [T, H] (model dtype), `input_ids` [T] and, when stored, `argmax`
[T] and `target_logprob` [T] float32 (the rejection scheme's p_T of each completion token, cache.sampling). A sample
never spans shards. cache.writer writes it; the manifest's format and its checks are cache.manifest's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.manifest import CacheError
from dflash_eval.cache.verify import ShardVerifier, repair_command

__all__ = ["CacheError", "HiddenCache", "SampleStates"]


def shard_name(index: int) -> str:
    """File name of shard `index`."""
    return f"shard_{index:05d}.safetensors"


LOGPROB_KEY = "target_logprob"  # tensor name of the target's per-token log-probabilities


def layer_key(layer_id: int) -> str:
    """Tensor name of a layer inside a shard."""
    return f"layer.{layer_id}"


@dataclass
class SampleStates:
    """One cached sample: tokens [T], features [T, n*H] in the requested layer order, argmax [T]."""

    input_ids: torch.Tensor
    features: torch.Tensor
    argmax: torch.Tensor | None
    prompt_len: int
    logprob: torch.Tensor | None = None  # [T] float32 log p_T(x_t | x_<t), NaN at prompt positions; when stored


class HiddenCache:
    """Read-only view of a hidden cache directory, validated on open (cache.manifest.load, then shard sizes).

    With `verify`, every shard a sample is read from is checked against its manifest sha256 (in the
    background, see cache.verify): call `verified()` before trusting what was computed from them.
    """

    def __init__(self, directory: str | Path, verify: bool = False) -> None:
        self.directory = Path(directory)
        self.manifest: dict[str, Any] = cache_manifest.load(self.directory)
        self._check_sizes()
        self._by_id = {entry["id"]: entry for entry in self.manifest["samples"]}
        self.verifier = ShardVerifier(self.directory, self.manifest) if verify else None

    def _check_sizes(self) -> None:
        """Each shard's size against the manifest: a truncated or damaged shard named before anything is read."""
        for shard in self.manifest["shards"]:
            path = self.directory / shard["file"]
            size = path.stat().st_size
            if size != shard["bytes"]:
                raise CacheError(
                    f"{path}: {size} bytes, but the manifest says {shard['bytes']}: the shard is "
                    f"{'truncated' if size < shard['bytes'] else 'damaged'}; "
                    f"{repair_command(self.directory, self.manifest)}"
                )

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def backend(self) -> dict[str, Any]:
        return dict(self.manifest["backend"])

    @property
    def samples(self) -> list[dict[str, Any]]:
        return list(self.manifest["samples"])

    @property
    def store_argmax(self) -> bool:
        return bool(self.manifest["store_argmax"])

    @property
    def target_logprobs(self) -> dict[str, Any] | None:
        """The manifest's record of the stored target log-probs (convention, per-sample sampling), or None."""
        return self.manifest.get("target_logprobs")

    def sample(self, sample_id: str) -> dict[str, Any]:
        """Manifest entry of one sample."""
        try:
            return self._by_id[sample_id]
        except KeyError:
            raise CacheError(f"sample {sample_id!r} is not in the hidden cache {self.directory}") from None

    def load_sample(
        self, sample_id: str, layer_ids: Sequence[int] | None = None, dtype: torch.dtype | None = None
    ) -> SampleStates:
        """States of one sample, concatenated over `layer_ids` in that order (default: the cache's).

        Features keep the stored dtype unless `dtype` is given.
        """
        layer_ids = self.layer_ids if layer_ids is None else list(layer_ids)
        absent = [i for i in layer_ids if i not in self.manifest["layer_ids"]]
        if absent:
            raise CacheError(
                f"layers {absent} are not in the hidden cache {self.directory} "
                f"(it holds {self.layer_ids}); extract a layer set that includes them"
            )
        entry = self.sample(sample_id)
        rows = slice(entry["offset"], entry["offset"] + entry["length"])
        if self.verifier is not None:
            self.verifier.touch(entry["shard"])
        try:
            with safe_open(str(self.directory / entry["shard"]), framework="pt") as handle:
                features = torch.cat([handle.get_slice(layer_key(i))[rows] for i in layer_ids], dim=-1)
                input_ids = handle.get_slice("input_ids")[rows]
                argmax = handle.get_slice("argmax")[rows] if self.store_argmax else None
                logprob = handle.get_slice(LOGPROB_KEY)[rows] if self.target_logprobs else None
        except SafetensorError as error:
            raise CacheError(
                f"{self.directory / entry['shard']}: not a readable safetensors shard ({error}); "
                f"{repair_command(self.directory, self.manifest)}"
            ) from None
        if dtype is not None:
            features = features.to(dtype)
        return SampleStates(
            input_ids=input_ids, features=features, argmax=argmax, prompt_len=entry["prompt_len"], logprob=logprob
        )

    def verified(self) -> list[dict[str, Any]]:
        """Wait for the hashes of every shard read so far; raise for a damaged one; what matched, for the record."""
        return [] if self.verifier is None else self.verifier.record()

    def verify(self) -> None:
        """Check every shard's sha256 against the manifest now (reads all bytes; sizes were checked on open)."""
        verifier = ShardVerifier(self.directory, self.manifest)
        for shard in self.manifest["shards"]:
            verifier.touch(shard["file"])
        verifier.check()
