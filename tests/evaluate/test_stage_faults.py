"""The evaluate stage on a damaged cache and on bad hand-written input: the real stage (CLI), a real tiny target,
drafter and cache. A damaged shard yields no metrics and names the shard and the command that repairs it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from dflash_eval import cli
from dflash_eval.extract import stage as extract_stage
from tests.support.extract_runs import evaluate_settings
from tests.support.tiny import tiny_drafter, tiny_target

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """Target, drafter, completions and their cache (two shards), plus the evaluate settings for them."""
    root = tmp_path_factory.mktemp("eval-faults")
    tiny_target().save_pretrained(root / "target")
    tiny_drafter(LAYERS).save_pretrained(root / "drafter", safe_serialization=True)
    rng = random.Random(0)
    records = []
    for index in range(4):
        ids = [rng.randrange(2, 290) for _ in range(12)]
        records.append(
            {
                "id": f"s{index}",
                "prompt_token_ids": ids[:3],
                "completion_token_ids": ids[3:],
                "request": {"max_tokens": 9},
                "completion_ids_source": "server",
                "token_check": {},
            }
        )
    completions = root / "c.jsonl"
    completions.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "shard_tokens": 24,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
        "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
    }
    extract_stage.extract(settings, completions, root / "hidden")
    evaluate = evaluate_settings(
        root,
        max_tokens=9,
        allow_backend_mismatch=False,
        block_sizes=[],
        ddtree_budgets=[4],
        topk=[1],
    )
    return root, evaluate


def _evaluate(root: Path, settings: dict, tmp_path: Path, hidden: Path | None = None) -> tuple[int, str, Path]:
    tmp_path.mkdir(exist_ok=True)
    log, metrics = tmp_path / "evaluate.log", tmp_path / "metrics.json"
    code = cli.main(
        [
            "--log",
            str(log),
            "evaluate",
            "--settings",
            json.dumps(settings),
            "--hidden",
            str(hidden or root / "hidden"),
            "--completions",
            str(root / "c.jsonl"),
            "--metrics",
            str(metrics),
            "--samples",
            str(tmp_path / "samples.csv"),
        ]
    )
    return code, log.read_text() if log.exists() else "", metrics


def test_every_shard_read_is_verified_and_recorded(project, tmp_path):
    root, settings = project
    code, log, metrics = _evaluate(root, settings, tmp_path)
    assert code == 0, log
    manifest = json.loads((root / "hidden" / "manifest.json").read_text())
    verified = json.loads(metrics.read_text())["cache"]["shards_verified"]
    assert [(v["file"], v["sha256"], v["bytes"]) for v in verified] == [
        (s["file"], s["sha256"], s["bytes"]) for s in manifest["shards"]
    ]
    # hand-written settings with `layer_ids: null`: the checkpoint's own list, not a TypeError
    unset = {**settings, "checkpoint": {**settings["checkpoint"], "layer_ids": None}}
    code, log, again = _evaluate(root, unset, tmp_path / "unset")
    assert code == 0, log
    assert json.loads(again.read_text())["chain"] == json.loads(metrics.read_text())["chain"]


def test_a_shard_with_flipped_bits_is_refused_naming_it_and_the_repair(project, tmp_path):
    root, settings = project
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for file in (root / "hidden").iterdir():
        (hidden / file.name).write_bytes(file.read_bytes())
    shard = hidden / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a layer's states: the numbers move, nothing else notices
    shard.write_bytes(bytes(data))
    code, log, metrics = _evaluate(root, settings, tmp_path, hidden)
    assert code == 2 and not metrics.exists() and not (tmp_path / "samples.csv").exists()
    assert f"{shard}: sha256 differs from the manifest" in log
    assert f"snakemake --forcerun {hidden}" in log and "dflash-eval extract --config config.yaml --dataset toy" in log
    assert shard.read_bytes() == bytes(data), "the evidence is left as it was"

    shard.write_bytes(bytes(data[:-9]))  # truncated: refused when the cache is opened, before any sample
    code, log, metrics = _evaluate(root, settings, tmp_path, hidden)
    assert code == 2 and not metrics.exists()
    assert f"{shard}: {len(data) - 9} bytes, but the manifest says {len(data)}: the shard is truncated" in log
    assert "Traceback" not in log


def test_unknown_names_and_a_cuda_device_without_cuda_are_named(project, tmp_path):
    root, settings = project
    config = {
        "target": {"path": str(root / "target"), "device": "cpu", "backend": "torch"},
        "server": {
            "kind": "external",
            "base_url": "http://127.0.0.1:9",
            "start_command": "true",
            "stop_command": "true",
        },
        "fetch": {},
        "extraction": {},
        "evaluation": {},
        "datasets": {"toy": {"prompts": "p.jsonl"}},
        "drafters": {"d": {"path": str(root / "drafter"), "trained_with": "torch"}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "evaluate.log"
    base = [
        "--log",
        str(log),
        "evaluate",
        "--config",
        str(tmp_path / "config.yaml"),
        "--hidden",
        str(root / "hidden"),
        "--completions",
        str(root / "c.jsonl"),
        "--metrics",
        str(tmp_path / "m.json"),
        "--samples",
        str(tmp_path / "s.csv"),
    ]
    assert cli.main([*base, "--drafter", "nope", "--dataset", "toy"]) == 2
    assert "--drafter 'nope': " in log.read_text() and "has no such entry under drafters; one of: d" in log.read_text()
    assert cli.main([*base, "--drafter", "d", "--dataset", "gsm8k"]) == 2
    assert "--dataset 'gsm8k': " in log.read_text()
    from dflash_eval.target_identity import torch_cuda_version

    if torch_cuda_version() is None:  # this machine's torch is a CPU build
        code, text, _ = _evaluate(root, {**settings, "device": "cuda:0"}, tmp_path)
        assert code == 2 and "evaluation.device is cuda:0, but the installed torch" in text
        assert "is built without CUDA" in text and "Traceback" not in text


def test_a_checkpoint_replaced_during_its_evaluation_writes_no_metrics(project, tmp_path, monkeypatch):
    """Before, metrics.json carried the new file's sha256 beside the old weights' tau."""
    from dflash_eval.evaluate import stage

    root, settings = project
    weights = next(Path(settings["checkpoint"]["path"]).glob("*.safetensors"))
    original = stage.drafter_section

    def replaced_meanwhile(*args, **kwargs):  # after every method ran, before the metrics are written
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        return original(*args, **kwargs)

    monkeypatch.setattr(stage, "drafter_section", replaced_meanwhile)
    before = weights.read_bytes()
    try:
        code, log, metrics = _evaluate(root, settings, tmp_path)
    finally:
        weights.write_bytes(before)  # the module's project is shared
    assert code == 2
    assert "the checkpoint changed while it was evaluated" in log and "no metrics are written" in log
    assert not metrics.exists() and not (tmp_path / "samples.csv").exists()


def test_the_attention_layout_is_recorded_and_an_unrunnable_one_refused(project, tmp_path):
    """metrics.json's attention_layout: each layer's layout and the keys that decided it; a config.json whose layout
    cannot run stops the evaluation at load, naming the file and the key."""
    import shutil

    root, settings = project
    code, log, metrics = _evaluate(root, settings, tmp_path / "plain")
    assert code == 0, log
    section = json.loads(metrics.read_text())["attention_layout"]
    assert section["rule"].startswith("vLLM 0.34.0")
    assert [(layer["causal"], layer["sliding_window"], layer["causal_from"]) for layer in section["layers"]] == [
        (True, 5, "layer_types"),
        (False, None, "layer_types"),
    ]
    causal = tmp_path / "causal-drafter"
    shutil.copytree(root / "drafter", causal)
    config = json.loads((causal / "config.json").read_text())
    config["dflash_config"]["causal"] = True
    (causal / "config.json").write_text(json.dumps(config))
    changed = {**settings, "checkpoint": {**settings["checkpoint"], "path": str(causal)}}
    code, log, metrics = _evaluate(root, changed, tmp_path / "causal")
    assert code == 0, log
    layers = json.loads(metrics.read_text())["attention_layout"]["layers"]
    assert [(layer["causal"], layer["causal_from"]) for layer in layers] == [(True, "dflash_config.causal")] * 2
    config["dflash_config"]["attention_value_scale"] = 0.5
    (causal / "config.json").write_text(json.dumps(config))
    code, log, metrics = _evaluate(root, changed, tmp_path / "refused")
    assert code != 0 and not metrics.exists()
    assert str(causal / "config.json") in log and "dflash_config.attention_value_scale is 0.5" in log, log
