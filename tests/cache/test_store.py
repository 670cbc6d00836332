"""Hidden cache: bit-exact round trip, sharding, atomic publication, corruption and NaN detection."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_eval.cache.store import CacheError, HiddenCache
from dflash_eval.cache.writer import CacheWriter

LAYERS = [1, 4, 7]
H = 8
HEADER = {
    "target": {
        "path": "t",
        "config_hash": "0" * 64,
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 8,
        "hidden_size": H,
        "dtype": "bfloat16",
    },
    "backend": {"name": "torch", "implementation": {}, "versions": {}},
    "device": "cpu",
    "completions": {"path": "c.jsonl", "sha256": "1" * 64},
}


def _sample(length: int, seed: int, argmax: bool = True):
    g = torch.Generator().manual_seed(seed)
    states = {i: torch.randn(length, H, generator=g).to(torch.bfloat16) for i in LAYERS}
    ids = torch.randint(0, 300, (length,), generator=g)
    return ids, states, (torch.randint(0, 300, (length,), generator=g) if argmax else None)


def _write(out, lengths, shard_tokens=10, store_argmax=True):
    samples = {}
    with CacheWriter(
        out, layer_ids=LAYERS, shard_tokens=shard_tokens, store_argmax=store_argmax, header=HEADER
    ) as writer:
        for n, length in enumerate(lengths):
            samples[f"s{n}"] = _sample(length, n, store_argmax)
            ids, states, argmax = samples[f"s{n}"]
            writer.add(f"s{n}", ids, states, argmax, prompt_len=min(2, length))
        writer.finish()
    return samples


def test_round_trip_is_bit_exact_across_shards(tmp_path):
    out = tmp_path / "cache"
    written = _write(out, [4, 5, 3, 12, 1])
    cache = HiddenCache(out)
    assert cache.layer_ids == LAYERS and cache.backend["name"] == "torch"
    assert [s["id"] for s in cache.samples] == list(written)
    assert len({s["shard"] for s in cache.samples}) > 1
    for sample_id, (ids, states, argmax) in written.items():
        loaded = cache.load_sample(sample_id, [7, 1])
        assert torch.equal(loaded.input_ids, ids) and loaded.input_ids.dtype == torch.int64
        assert torch.equal(loaded.features, torch.cat([states[7], states[1]], dim=-1))
        assert loaded.features.dtype == torch.bfloat16 and loaded.features.shape == (len(ids), 2 * H)
        assert torch.equal(loaded.argmax, argmax)
        assert loaded.prompt_len == min(2, len(ids))
    cache.verify()
    for shard in cache.manifest["shards"]:  # the hand-written files are plain safetensors
        tensors = load_file(out / shard["file"])
        assert set(tensors) == {"layer.1", "layer.4", "layer.7", "input_ids", "argmax"}
        assert tensors["layer.4"].dtype == torch.bfloat16 and len(tensors["input_ids"]) == shard["tokens"]


def test_shards_stay_within_shard_tokens_unless_one_sample_is_larger(tmp_path):
    out = tmp_path / "cache"
    _write(out, [4, 5, 3, 12, 1], shard_tokens=10)
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    assert [s["tokens"] for s in shards] == [9, 3, 12, 1]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [s["file"] for s in shards]


def test_storage_is_the_states_plus_at_most_one_percent(tmp_path):
    """At the target's scale (5 layers x 5120 bf16 = 51,200 bytes a token) everything else the cache stores
    (token ids, argmax, safetensors headers, the manifest), with the stage's shard plan, is <= 1% of that."""
    from dflash_eval.cache.resume import plan_shards

    layers, hidden = [1, 16, 31, 46, 61], 5120
    lengths = [300, 180, 420, 250, 96, 33]
    header = {**HEADER, "target": {**HEADER["target"], "hidden_size": hidden, "num_hidden_layers": 64}}
    out = tmp_path / "cache"
    with CacheWriter(out, layer_ids=layers, shard_tokens=512, store_argmax=True, header=header) as writer:
        for shard in plan_shards(lengths, 512):
            for n in shard:
                state = torch.zeros(lengths[n], hidden, dtype=torch.bfloat16)
                ids = torch.arange(lengths[n])
                writer.add(f"s{n}", ids, {i: state for i in layers}, ids, prompt_len=16)
            writer.close_shard()
        writer.finish()
    payload = sum(lengths) * len(layers) * hidden * 2
    stored = sum(f.stat().st_size for f in out.iterdir())
    assert len(list(out.glob("*.safetensors"))) >= 4  # the halving tail's extra headers are counted too
    assert payload < stored <= 1.01 * payload, (stored - payload) / payload


def test_host_memory_is_a_few_shard_buffers_whatever_the_dataset_size(tmp_path, monkeypatch):
    """Buffers are allocated once (WRITER_THREADS + 1 of shard_tokens rows) and reused for every shard."""
    from dflash_eval.cache import writer as cache

    allocated: list[int] = []

    class Counted(cache._ShardBuffer):
        def __init__(self, layer_ids, capacity, *args, **kwargs):
            allocated.append(capacity)
            super().__init__(layer_ids, capacity, *args, **kwargs)

    monkeypatch.setattr(cache, "_ShardBuffer", Counted)
    _write(tmp_path / "cache", [5, 3, 2] * 40)  # 40 shards of 10 tokens
    assert len(HiddenCache(tmp_path / "cache").manifest["shards"]) == 40
    assert allocated == [10] * (cache.WRITER_THREADS + 1)


def test_samples_longer_than_a_shard_hold_one_one_off_buffer_at_a_time(tmp_path):
    """A thinking model's long completions each get a one-off buffer; with a slow disk they must not
    pile up in host memory: the next one waits for the previous one's write."""
    import time

    from dflash_eval.cache import writer as cache

    class SlowDisk(CacheWriter):
        @staticmethod
        def write_shard(*args, **kwargs):
            time.sleep(0.05)
            return cache._write_shard(*args, **kwargs)

    pending = []
    with SlowDisk(tmp_path / "cache", layer_ids=LAYERS, shard_tokens=8, store_argmax=True, header=HEADER) as writer:
        for n in range(8):
            writer.add(f"s{n}", *_sample(20, n), prompt_len=2)
            pending.append(sum(not shard.done() for shard in writer._shards))
        writer.finish()
    assert max(pending) == 1
    assert len(HiddenCache(tmp_path / "cache").manifest["shards"]) == 8
    HiddenCache(tmp_path / "cache").verify()


def test_manifest_follows_the_contract(tmp_path):
    out = tmp_path / "cache"
    _write(out, [3, 3], store_argmax=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_version"] == 1
    assert {"target", "layer_ids", "backend", "device", "completions", "store_argmax", "samples", "shards"} <= set(
        manifest
    )
    assert set(manifest["samples"][0]) == {"id", "shard", "offset", "length", "prompt_len"}
    assert set(manifest["shards"][0]) == {"file", "sha256", "bytes", "tokens", "mtime_ns"}
    assert HiddenCache(out).load_sample("s1").argmax is None


def test_missing_layers_are_named(tmp_path):
    _write(tmp_path / "cache", [3])
    with pytest.raises(CacheError, match=r"layers \[2, 9\] are not in the hidden cache"):
        HiddenCache(tmp_path / "cache").load_sample("s0", [1, 2, 9])


def test_missing_directory_or_manifest_names_path_and_fix(tmp_path):
    with pytest.raises(CacheError, match=r"directory not found: .*nowhere/manifest.json; build it"):
        HiddenCache(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheError, match="manifest not found"):
        HiddenCache(tmp_path / "empty")


def test_verify_detects_a_corrupt_shard(tmp_path):
    out = tmp_path / "cache"
    _write(out, [4, 5])
    shard = out / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="shard_00000.safetensors: sha256 differs"):
        HiddenCache(out).verify()
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(CacheError, match="bytes, but the manifest says .*: the shard is truncated"):
        HiddenCache(out)  # sizes are checked on open


def test_a_failure_midway_leaves_no_output_and_no_partial_files(tmp_path):
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="forward failed"):
        with CacheWriter(out, layer_ids=LAYERS, shard_tokens=4, store_argmax=True, header=HEADER) as writer:
            for n in range(3):
                writer.add(f"s{n}", *_sample(5, n), prompt_len=1)  # each flushes a shard
            raise RuntimeError("forward failed")
    assert list(tmp_path.iterdir()) == []


def test_an_old_cache_survives_a_failed_rewrite_and_is_replaced_by_a_good_one(tmp_path):
    out = tmp_path / "cache"
    _write(out, [3])
    with pytest.raises(RuntimeError):
        with CacheWriter(out, layer_ids=LAYERS, shard_tokens=4, store_argmax=True, header=HEADER) as writer:
            writer.add("new", *_sample(5, 9), prompt_len=1)
            raise RuntimeError
    assert [s["id"] for s in HiddenCache(out).samples] == ["s0"]
    _write(out, [2, 2, 2])
    assert [s["id"] for s in HiddenCache(out).samples] == ["s0", "s1", "s2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_states_name_the_sample_and_layer(tmp_path, bad):
    ids, states, argmax = _sample(6, 0)
    states[4][3, 2] = bad
    with pytest.raises(CacheError, match=r"sample 'broken', layer 4: 1 non-finite values .* token 3"):
        with CacheWriter(
            tmp_path / "cache", layer_ids=LAYERS, shard_tokens=100, store_argmax=True, header=HEADER
        ) as writer:
            writer.add("broken", ids, states, argmax, prompt_len=1)
    assert list(tmp_path.iterdir()) == []


def test_inconsistent_samples_are_rejected(tmp_path):
    with CacheWriter(tmp_path / "c", layer_ids=LAYERS, shard_tokens=100, store_argmax=True, header=HEADER) as writer:
        ids, states, argmax = _sample(4, 0)
        writer.add("a", ids, states, argmax, prompt_len=1)
        with pytest.raises(CacheError, match="appears twice"):
            writer.add("a", ids, states, argmax, prompt_len=1)
        with pytest.raises(CacheError, match="layers"):
            writer.add("b", ids, {1: states[1]}, argmax, prompt_len=1)
        with pytest.raises(CacheError, match="argmax missing"):
            writer.add("b", ids, states, None, prompt_len=1)
        with pytest.raises(CacheError, match="prompt_len 9"):
            writer.add("b", ids, states, argmax, prompt_len=9)
        writer.abort()


def test_a_manifest_pointing_outside_its_shard_is_rejected(tmp_path):
    out = tmp_path / "cache"
    _write(out, [3])
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["samples"][0]["length"] = 99
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="points outside its shard"):
        HiddenCache(out)


@pytest.mark.gpu
def test_gpu_states_round_trip_through_the_side_stream_while_their_memory_is_reused(tmp_path):
    """CUDA samples: copies on the writer's side stream, states freed (and overwritten) right after add."""
    out, device, written = tmp_path / "cache", torch.device("cuda"), {}
    with CacheWriter(out, layer_ids=LAYERS, shard_tokens=10, store_argmax=True, header=HEADER) as writer:
        for n, length in enumerate([4, 5, 3, 12, 1, 6]):
            ids, states, argmax = _sample(length, n)
            written[f"s{n}"] = (ids, states, argmax)
            on_gpu = {i: s.to(device) for i, s in states.items()}
            writer.add(f"s{n}", ids.to(device), on_gpu, argmax.to(device), prompt_len=1)
            del on_gpu
            torch.full((1 << 20,), float("nan"), device=device)  # reuses freed blocks unless they are held
        writer.finish()
    cache = HiddenCache(out)
    for sample_id, (ids, states, argmax) in written.items():
        loaded = cache.load_sample(sample_id, LAYERS)
        assert torch.equal(loaded.input_ids, ids) and torch.equal(loaded.argmax, argmax)
        assert torch.equal(loaded.features, torch.cat([states[i] for i in LAYERS], dim=-1))


@pytest.mark.gpu
def test_gpu_non_finite_state_is_caught_before_its_shard_is_written(tmp_path):
    """On CUDA the NaN flags are read by the shard's writer thread, not per sample on the main thread;
    the error still names sample, layer and token, and no file of that shard is written."""
    device = torch.device("cuda")
    with pytest.raises(CacheError, match=r"sample 'broken', layer 4: 1 non-finite values .* token 3"):
        with CacheWriter(
            tmp_path / "cache", layer_ids=LAYERS, shard_tokens=100, store_argmax=True, header=HEADER
        ) as writer:
            for name, seed in (("fine", 1), ("broken", 2), ("after", 3)):
                ids, states, argmax = _sample(6, seed)
                if name == "broken":
                    states[4][3, 2] = float("nan")
                writer.add(
                    name, ids.to(device), {i: s.to(device) for i, s in states.items()}, argmax.to(device), prompt_len=1
                )
            writer.finish()
    assert list(tmp_path.iterdir()) == []
