"""Settings of the extract and evaluate stages on a tiny target, and a counter of the forwards it runs (optionally
interrupting one), and tiny completions and the states a cache holds: shared by the cache resume and extract fault
tests."""

import json
import random

import torch

from dflash_eval.cache.store import HiddenCache
from dflash_eval.extract import stage as extract_stage

LAYERS = [0, 2]


def extract_settings(target_dir, **overrides):
    """Extract-stage settings for the tiny target in `target_dir` (shards of 10 tokens, layers LAYERS)."""
    settings = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "shard_tokens": 10,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
        "target": {"path": str(target_dir), "dtype": "float32", "device": "cpu", "backend": "torch"},
    }
    settings.update(overrides)
    return settings


def evaluate_settings(root, **overrides):
    """Evaluate-stage settings for the tiny drafter `root / "drafter"` on the tiny target `root / "target"`
    (layers LAYERS, the CPU in fp32, stop token 1); `overrides` set the methods, max_tokens and the rest."""
    settings = {
        "drafter": "d",
        "dataset": "toy",
        "target": {"path": str(root / "target")},
        "checkpoint": {
            "path": str(root / "drafter"),
            "layout": "auto",
            "config": None,
            "trained_with": "torch",
            "allow_pickle": False,
            "step": None,
            "layer_ids": LAYERS,
        },
        "device": "cpu",
        "dtype": "float32",
        "blocks_per_forward": 16,
        "bootstrap": 10,
        "seed": 0,
        "stop_token_ids": [1],
    }
    settings.update(overrides)
    return settings


class Counting:
    """Counts (and optionally stops) the forwards the extract stage runs."""

    def __init__(self, monkeypatch, stop_at: int | None = None):
        self.calls = 0
        original = extract_stage.capture_layers

        def capture(*args, **kwargs):
            if stop_at is not None and self.calls == stop_at:
                raise KeyboardInterrupt  # what Ctrl-C or a scheduler's kill looks like from inside
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(extract_stage, "capture_layers", capture)


def tiny_records(lengths, seed=0):
    rng = random.Random(seed)
    records = []
    for index, length in enumerate(lengths):
        ids = [rng.randrange(2, 290) for _ in range(length)]
        records.append(
            {
                "id": f"s{index}",
                "prompt_token_ids": ids[:2],
                "completion_token_ids": ids[2:],
                "completion_ids_source": "server",
                "token_check": {},
            }
        )
    return records


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cache_states(out):
    """Every sample's states, copied out of the shards (a slice may map the file, which a test then changes)."""
    cache = HiddenCache(out)
    loaded = {s["id"]: cache.load_sample(s["id"]) for s in cache.samples}
    for states in loaded.values():
        states.features, states.argmax, states.input_ids = (
            t.clone() for t in (states.features, states.argmax, states.input_ids)
        )
    return loaded


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].features, b[key].features) and torch.equal(a[key].argmax, b[key].argmax)
        assert torch.equal(a[key].input_ids, b[key].input_ids) and a[key].prompt_len == b[key].prompt_len
