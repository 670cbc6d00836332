"""The extract stage end to end on a tiny saved target, plus target loading and its config hash."""

import argparse
import contextlib
import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from dflash_eval.cache.store import HiddenCache
from dflash_eval.errors import DflashEvalError
from dflash_eval.extract import stage as extract_stage
from dflash_eval.extract.backends import BackendUnavailable, use_backend
from dflash_eval.extract.target import load_target, target_config_hash
from tests.support.tiny import tiny_target

LAYERS = [2, 0]  # cache order follows the request


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path


def _record(sample_id, prompt, completion, **extra):
    return {
        "id": sample_id,
        "dataset": "toy",
        "messages": [],
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "text": "",
        "finish_reason": "stop",
        "completion_ids_source": "server",
        "token_check": {"prompt_tokens_match": True, "completion_tokens_match": True},
        **extra,
    }


RECORDS = [
    _record("a", [5, 6, 7, 8], [9, 10, 11]),
    _record("b", [12, 13], [14, 15, 16, 17, 18, 1], completion_ids_source="retokenized"),
    _record("c", [20, 21, 22], [23], token_check={"prompt_tokens_match": True, "completion_tokens_match": False}),
]


@pytest.fixture
def completions(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def _settings(target_dir, **overrides):
    settings = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "target": {"path": str(target_dir), "dtype": "float32", "device": "cpu", "backend": "torch"},
        "shard_tokens": 10,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
    }
    settings.update(overrides)
    return settings


def test_extract_end_to_end_matches_the_targets_own_forward(target_dir, completions, tmp_path):
    out = tmp_path / "hidden" / "toy" / "L2-0"
    extract_stage.extract(_settings(target_dir), completions, out)
    cache = HiddenCache(out)
    cache.verify()
    reference = tiny_target()
    for record in RECORDS:
        ids = torch.tensor(record["prompt_token_ids"] + record["completion_token_ids"])
        with torch.no_grad(), use_backend("torch", "cpu"):
            expected = reference(ids[None], output_hidden_states=True, use_cache=False)
        loaded = cache.load_sample(record["id"])
        assert torch.equal(loaded.input_ids, ids)
        assert torch.equal(
            loaded.features, torch.cat([expected.hidden_states[3][0], expected.hidden_states[1][0]], dim=-1)
        )
        assert torch.equal(loaded.argmax, expected.logits[0].argmax(-1))
        assert loaded.prompt_len == len(record["prompt_token_ids"])
    manifest = cache.manifest
    assert manifest["backend"]["name"] == "torch"
    assert manifest["backend"]["implementation"]["chunk"].endswith("modeling_qwen3_5.torch_chunk_gated_delta_rule")
    assert manifest["backend"]["calls"]["chunk"] == 3 * len(RECORDS)
    assert manifest["target"]["config_hash"] == target_config_hash(target_dir)
    assert manifest["target"]["num_hidden_layers"] == 4 and manifest["target"]["dtype"] == "float32"
    assert manifest["completions"]["path"] == str(completions)
    assert manifest["token_flags"] == {"mismatch": ["c"], "retokenized": ["b"]}
    assert manifest["layer_ids"] == LAYERS and manifest["device"] == "cpu"
    # random completions: the tiny target's greedy choice matches them only by chance
    assert manifest["argmax_agreement"]["tokens"] == sum(len(r["completion_token_ids"]) for r in RECORDS)


def test_argmax_agreement_is_complete_for_the_targets_own_greedy_output(target_dir, tmp_path):
    model = tiny_target()
    prompt = [5, 6, 7, 8]
    with torch.no_grad(), use_backend("torch", "cpu"):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    path = tmp_path / "greedy.jsonl"
    path.write_text(json.dumps(_record("g", prompt, out[0, len(prompt) :].tolist())) + "\n")
    extract_stage.extract(_settings(target_dir), path, tmp_path / "cache")
    assert HiddenCache(tmp_path / "cache").manifest["argmax_agreement"] == {"matches": 6, "tokens": 6}


@pytest.mark.parametrize("last_layer", ["final_norm", "pre_norm"])
def test_last_captured_layer_is_the_drafters_convention_and_recorded(target_dir, completions, tmp_path, last_layer):
    """Layer 3 is the last: the cache holds the final-norm output (what dflash_generate feeds, the default)
    or, pre_norm, the norm's input; the manifest says which."""
    out = tmp_path / "cache"
    extract_stage.extract({**_settings(target_dir, layer_ids=[3]), "last_layer": last_layer}, completions, out)
    reference = tiny_target()
    ids = torch.tensor(RECORDS[0]["prompt_token_ids"] + RECORDS[0]["completion_token_ids"])
    with torch.no_grad(), use_backend("torch", "cpu"):
        expected = reference(ids[None], output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        cached = HiddenCache(out).load_sample("a").features
        assert torch.equal(reference.model.norm(cached) if last_layer == "pre_norm" else cached, expected)
    assert HiddenCache(out).manifest["target"]["last_layer"] == last_layer


def test_bf16_and_no_argmax(target_dir, completions, tmp_path):
    out = tmp_path / "cache"
    extract_stage.extract(
        _settings(
            target_dir,
            store_argmax=False,
            target={"path": str(target_dir), "dtype": "bfloat16", "device": "cpu", "backend": "torch"},
        ),
        completions,
        out,
    )
    sample = HiddenCache(out).load_sample("b")
    assert sample.features.dtype == torch.bfloat16 and sample.argmax is None
    assert HiddenCache(out).manifest["target"]["dtype"] == "bfloat16"


def test_strict_tokens_fails_before_anything_is_written(target_dir, completions, tmp_path):
    with pytest.raises(DflashEvalError, match="strict_tokens: 1 samples with token_check mismatches and 1 with"):
        extract_stage.extract(_settings(target_dir, strict_tokens=True), completions, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_fla_on_cpu_fails_before_the_server_is_touched(target_dir, completions, tmp_path, monkeypatch):
    events = _fake_server(monkeypatch)
    settings = _settings(target_dir, server={"kind": "external"})
    settings["target"]["backend"] = "fla"
    with pytest.raises(BackendUnavailable, match="'fla' cannot run on device 'cpu'"):
        extract_stage.extract(settings, completions, tmp_path / "cache")
    assert events == []


def test_model_runs_inside_the_server_pause(target_dir, completions, tmp_path, monkeypatch):
    events = _fake_server(monkeypatch)
    real_load = extract_stage.load_target

    def load(*args, **kwargs):
        events.append("load")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(extract_stage, "load_target", load)
    extract_stage.extract(_settings(target_dir, server={"kind": "external"}), completions, tmp_path / "cache")
    assert events == [("pause", "external"), "load", "resume"]


def test_out_of_vocabulary_ids_name_the_sample(target_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_record("oov", [1, 2], [300])) + "\n")
    with pytest.raises(DflashEvalError, match="sample 'oov' has token ids outside the target's vocabulary"):
        extract_stage.extract(_settings(target_dir), path, tmp_path / "cache")


def test_run_with_settings_json(target_dir, completions, tmp_path):
    parser = argparse.ArgumentParser()
    extract_stage.add_arguments(parser)
    out = tmp_path / "cache"
    args = parser.parse_args(
        ["--settings", json.dumps(_settings(target_dir)), "--completions", str(completions), "--out", str(out)]
    )
    assert extract_stage.run(args) == 0
    assert [s["id"] for s in HiddenCache(out).samples] == ["a", "b", "c"]


def test_layers_flag_parses():
    assert extract_stage.parse_layers("1,16, 31") == [1, 16, 31]
    with pytest.raises(DflashEvalError, match="comma-separated integers"):
        extract_stage.parse_layers("1;2")


def _fake_server(monkeypatch):
    events = []

    @contextlib.contextmanager
    def server_paused(settings):
        events.append(("pause", settings["kind"]))
        try:
            yield
        finally:
            events.append("resume")

    monkeypatch.setitem(sys.modules, "dflash_eval.server.control", types.SimpleNamespace(server_paused=server_paused))
    return events


# --- target loading -------------------------------------------------------------------------


def _vlm_dir(tmp_path, causal):
    config = Qwen3_5Config(
        text_config=causal.config.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    vlm = Qwen3_5ForConditionalGeneration(config).eval()
    vlm.model.language_model.load_state_dict(causal.model.state_dict())
    vlm.lm_head.load_state_dict(causal.lm_head.state_dict())
    vlm.save_pretrained(tmp_path / "vlm")
    return tmp_path / "vlm", vlm


def test_vlm_checkpoint_loads_as_its_text_model(tmp_path):
    causal = tiny_target()
    path, vlm = _vlm_dir(tmp_path, causal)
    model, config = load_target(path, "float32", "cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and config.num_hidden_layers == 4
    tokens = torch.arange(2, 30)[None]
    with torch.no_grad(), use_backend("torch", "cpu"):
        assert torch.equal(model(tokens, use_cache=False).logits, vlm(input_ids=tokens, use_cache=False).logits)


def test_default_dtype_is_bf16(target_dir):
    model, _ = load_target(target_dir)
    assert model.dtype == torch.bfloat16 and not model.training


def test_a_missing_weight_is_an_error(target_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((target_dir / "config.json").read_text())
    tensors = load_file(target_dir / "model.safetensors")
    del tensors["model.layers.2.linear_attn.in_proj_qkv.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DflashEvalError, match="did not load cleanly.*missing_keys.*layers.2.linear_attn"):
        load_target(broken, "float32", "cpu")


def test_config_hash_is_the_text_config_and_ignores_provenance(target_dir, tmp_path):
    causal = tiny_target()
    vlm_path, _ = _vlm_dir(tmp_path, causal)
    config = json.loads((target_dir / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    assert target_config_hash(tmp_path / "copy") == target_config_hash(target_dir)
    config["num_hidden_layers"] = 5
    (tmp_path / "copy" / "config.json").write_text(json.dumps(config))
    assert target_config_hash(tmp_path / "copy") != target_config_hash(target_dir)
    assert len(target_config_hash(vlm_path)) == 64


def test_missing_target_dir_names_the_path(tmp_path):
    with pytest.raises(DflashEvalError, match="nowhere/config.json not found"):
        load_target(tmp_path / "nowhere")


@pytest.mark.gpu
def test_extract_on_cuda_with_fla_differs_slightly_from_torch(target_dir, completions, tmp_path):
    features = {}
    for backend in ("fla", "torch"):
        settings = _settings(
            target_dir, target={"path": str(target_dir), "dtype": "bfloat16", "device": "cuda:0", "backend": backend}
        )
        extract_stage.extract(settings, completions, tmp_path / backend)
        cache = HiddenCache(tmp_path / backend)
        assert cache.backend["name"] == backend and cache.manifest["device"] == "cuda:0"
        assert cache.backend["implementation"]["chunk"].startswith(
            "fla." if backend == "fla" else "transformers.models.qwen3_5"
        )
        features[backend] = cache.load_sample("a").features.float()
    assert torch.nn.functional.cosine_similarity(features["fla"], features["torch"], dim=-1).min() > 0.99


def test_a_sample_past_max_position_embeddings_is_named_recorded_and_still_extracted(
    target_dir, completions, tmp_path, caplog
):
    """Issue 32: preflight sees only fetch.max_tokens; a long prompt passes the positions with any max_tokens."""
    import shutil

    from dflash_eval.report.markdown import trust_warnings
    from dflash_eval.report.trust import cache_entry

    short = tmp_path / "target"
    shutil.copytree(target_dir, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 6  # a: 7 tokens, b: 8, c: 4
    (short / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        out = extract_stage.extract(_settings(short), completions, tmp_path / "hidden")
    assert (
        f"2 of 3 samples of {completions} run past the target's max_position_embeddings 6 (prompt + completion): "
        "a, b;" in caplog.text
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["positions"] == {"max_position_embeddings": 6, "past": ["a", "b"]}
    assert [s["id"] for s in HiddenCache(out).samples] == ["a", "b", "c"], "every sample is still extracted"
    found = trust_warnings(
        {"fetch": {}, "caches": [cache_entry(out, None)], "online": {}, "server": {"recorded": False}}
    )
    assert found == [
        f"**Past the target's positions**: {out}: 2 of 3 samples are longer than its "
        "max_position_embeddings 6 (e.g. a, b); the target's states there are extrapolated."
    ]
    manifest["positions"] = None  # the demo, and caches from before the record: no warning
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert (
        trust_warnings({"fetch": {}, "caches": [cache_entry(out, None)], "online": {}, "server": {"recorded": False}})
        == []
    )
