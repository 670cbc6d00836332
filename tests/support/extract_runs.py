"""Settings of the extract stage on a tiny target, and a counter of the forwards it runs (optionally
interrupting one): shared by the cache resume and extract fault tests."""

from dflash_eval.extract import stage as extract_stage

LAYERS = [0, 2]


def extract_settings(target_dir, **overrides):
    """Extract-stage settings for the tiny target in `target_dir` (shards of 10 tokens, layers LAYERS)."""
    settings = {"dataset": "toy", "layer_ids": LAYERS, "shard_tokens": 10, "store_argmax": True,
                "strict_tokens": False, "server": None,
                "target": {"path": str(target_dir), "dtype": "float32", "device": "cpu", "backend": "torch"}}
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
