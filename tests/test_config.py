"""config.py: config.yaml validation, step directories and selections, layer sets, and the one function that
fills and checks every stage's settings from the schema's defaults (workflow-built or written by hand)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import yaml

from dflash_eval import config as cfg
from dflash_eval.config import select
from dflash_eval.drafters import expand_step_directories, layerset_name, parse_layerset
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.settings import evaluate_settings
from dflash_eval.extract.settings import extract_params, extract_settings
from dflash_eval.fetch.settings import fetch_settings
from dflash_eval.provenance import code_version
from dflash_eval.report.settings import report_settings
from dflash_eval.server.control import ServerController

REPO = Path(__file__).resolve().parents[1]
# The schema read here on its own, as the reference the filled settings are held against.
SCHEMA = yaml.safe_load((REPO / "src" / "dflash_eval" / "config.schema.yaml").read_text())
SECTION_DEFAULTS = {
    section: {
        key: sub["default"] for key, sub in SCHEMA["properties"][section]["properties"].items() if "default" in sub
    }
    for section in ("server", "fetch", "target", "extraction", "evaluation", "report", "demo")
}
DATASET_DEFAULTS = {
    key: sub["default"]
    for key, sub in SCHEMA["properties"]["datasets"]["additionalProperties"]["properties"].items()
    if "default" in sub
}


def base_config(tmp_path, datasets):
    return {
        "target": {"path": "t", "device": "cpu", "backend": "torch"},
        "server": {"kind": "release", "base_url": "http://127.0.0.1:1"},
        "fetch": {},
        "extraction": {},
        "evaluation": {},
        "drafters": {"d": {"path": str(tmp_path / "d"), "layer_ids": [1]}},
        "datasets": datasets,
    }


def repo_config() -> dict:
    return cfg.load_config(REPO / "config.yaml")


# ----- config.yaml -----


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"preset": "gsm8k", "prompts": "p.jsonl"}, r"datasets.x: give either prompts .* or preset"),
        ({"max_samples": 3}, r"datasets.x: give either prompts"),
        (
            {"preset": "gsm8"},
            r"datasets.x.preset: unknown preset 'gsm8'; one of gsm8k, math500, humaneval, mbpp, mt-bench",
        ),
        ({"prompts": "p.jsonl", "source": "x"}, r"datasets.x.source only goes with preset"),
        ({"preset": "gsm8k", "sorce": "x"}, r"datasets.x: Additional properties are not allowed \('sorce'"),
    ],
)
def test_bad_dataset_entries_are_named(tmp_path, entry, message):
    with pytest.raises(DflashEvalError, match=message):
        cfg.validate_config(base_config(tmp_path, {"x": entry}))


def test_every_error_is_listed_with_its_key_and_what_is_allowed(tmp_path):
    config = base_config(tmp_path, {"x": {"prompts": "p.jsonl"}})
    config["server"]["kind"] = "docker"
    config["fetch"]["concurency"] = 2
    with pytest.raises(DflashEvalError) as error:
        cfg.validate_config(config, "my.yaml")
    message = str(error.value)
    assert message.startswith("my.yaml is not valid:\n")
    assert (
        "fetch: Additional properties are not allowed ('concurency' was unexpected) (allowed keys: backoff_s,"
        in message
    )
    assert "server.kind: unknown kind 'docker'; one of managed, external, release" in message


def test_server_rules_of_config_yaml_are_the_server_stages(tmp_path):
    config = base_config(tmp_path, {"x": {"prompts": "p.jsonl"}})
    config["server"] = {"kind": "managed", "base_url": "http://127.0.0.1:1"}
    with pytest.raises(DflashEvalError, match=r"^config.yaml: server.command is required for kind: managed"):
        cfg.validate_config(config)


def test_sections_left_out_get_their_defaults(tmp_path):
    config = cfg.validate_config(base_config(tmp_path, {"x": {"prompts": "p.jsonl"}}))
    assert config["demo"] == SECTION_DEFAULTS["demo"] and config["demo"]["enabled"] is False
    assert config["report"] == SECTION_DEFAULTS["report"]
    assert config["fetch"] == SECTION_DEFAULTS["fetch"]
    assert config["datasets"]["x"] == {"prompts": "p.jsonl", **DATASET_DEFAULTS}


def test_the_demo_of_config_yaml_is_enabled_with_the_schemas_target_steps():
    """The demo has always trained its target 300 steps (config.yaml's value; tests/workflow/test_snakefile.py: the
    rule's command); the schema's default is the same, so a config without the key trains it as long."""
    demo = repo_config()["demo"]
    assert demo["enabled"] is True and demo["target_steps"] == 300 == SECTION_DEFAULTS["demo"]["target_steps"]


def test_load_config_names_a_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(DflashEvalError, match=r"config file .*absent.yaml not found"):
        cfg.load_config(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("target: [unclosed\n")
    with pytest.raises(DflashEvalError, match=r"bad.yaml:2:1: not valid YAML"):
        cfg.load_config(tmp_path / "bad.yaml")


def test_preset_names_of_the_schema_are_the_presets_fetch_loads():
    from dflash_eval.fetch.presets import PRESETS

    assert cfg.preset_names() == list(PRESETS)


# ----- step directories, selections, layer sets -----


def test_step_directory_expands_in_step_order(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    for step in (20, 3, 100):
        (run / f"step_{step}.pt").write_bytes(b"x")
    (run / "notes.txt").write_text("ignored")
    hf = run.parent / "hf-run"
    (hf / "checkpoint-5").mkdir(parents=True)
    (hf / "checkpoint-5" / "config.json").write_text("{}")
    drafters = {
        "first": {"path": "elsewhere.pt"},
        "v4": {"path": str(run), "config": None},
        "hf": {"path": str(hf), "config": None},
    }
    out = expand_step_directories(drafters, "config.yaml")
    assert list(out) == ["first", "v4-step3", "v4-step20", "v4-step100", "hf-step5"]
    assert out["v4-step20"]["step"] == 20 and out["v4-step20"]["run"] == "v4"
    assert out["v4-step20"]["config"] == str(run / "config.json")
    assert out["hf-step5"]["config"] is None and out["hf-step5"]["path"] == str(hf / "checkpoint-5")


def test_bare_steps_without_a_config_are_an_error(tmp_path):
    (tmp_path / "step_1.pt").write_bytes(b"x")
    with pytest.raises(DflashEvalError, match="drafters.v4.config"):
        expand_step_directories({"v4": {"path": str(tmp_path), "config": None}}, "config.yaml")


def test_select_names_patterns_and_series():
    names = ["a", "v4-step1", "v4-step2", "b"]
    assert select(None, names, "only") == names
    assert select("b,a", names, "only") == ["a", "b"]
    assert select(["v4"], names, "only") == ["v4-step1", "v4-step2"]
    assert select("v4-*2", names, "only") == ["v4-step2"]
    with pytest.raises(DflashEvalError, match="'c' matches none of"):
        select("c", names, "--config only")


def test_layerset_names_round_trip_in_order():
    assert layerset_name([31, 1, 16], "final_norm") == "L31-1-16"
    assert parse_layerset("L31-1-16") == [31, 1, 16]
    with pytest.raises(DflashEvalError, match="must look like L1-16-31"):
        parse_layerset("1-16")


# ----- stage settings: one function, the schema's defaults -----


def test_fetch_settings_are_checked():
    with pytest.raises(DflashEvalError, match=r"missing \['server'\], unknown \['typo'\]"):
        cfg.stage_settings("fetch", {"dataset": "x", "prompts": "p", "tokenizer": "t", "typo": 1})
    for where in ({}, {"prompts": "p.jsonl", "preset": "gsm8k"}):
        with pytest.raises(DflashEvalError, match=r"give exactly one of prompts \(a file\) and preset"):
            cfg.stage_settings("fetch", {"dataset": "x", "server": {}, "tokenizer": "t", **where})


def test_settings_are_checked():
    with pytest.raises(DflashEvalError, match="server.command is required"):
        ServerController({"kind": "managed"})
    with pytest.raises(DflashEvalError, match="unknown server settings"):
        ServerController({"kind": "release", "port": 1})
    with pytest.raises(DflashEvalError, match="start_command and server.stop_command together"):
        ServerController({"kind": "release", "stop_command": "systemctl stop sglang"})


def test_hand_written_fetch_settings_get_the_schemas_defaults():
    settings = cfg.stage_settings("fetch", {"dataset": "x", "prompts": "p.jsonl", "tokenizer": "t", "server": {}})
    assert {key: settings[key] for key in SECTION_DEFAULTS["fetch"]} == SECTION_DEFAULTS["fetch"]
    assert {key: settings[key] for key in DATASET_DEFAULTS} == DATASET_DEFAULTS
    assert settings["preset"] is None and settings["prompts"] == "p.jsonl"  # every key there, unset ones None
    assert SECTION_DEFAULTS["fetch"]["max_tokens"] == 2048 and settings["backoff_s"] == 1.0


def test_hand_written_server_settings_get_the_schemas_defaults():
    settings = cfg.stage_settings("server", {"kind": "managed", "base_url": "http://127.0.0.1:5/", "command": "c"})
    defaulted = set(SECTION_DEFAULTS["server"]) - {"command"}
    assert {key: settings[key] for key in defaulted} == {key: SECTION_DEFAULTS["server"][key] for key in defaulted}
    assert settings["base_url"] == "http://127.0.0.1:5" and settings["command"] == "c"
    assert ServerController({"kind": "managed", "base_url": "http://127.0.0.1:5/", "command": "c"}).settings == settings


def test_hand_written_extract_evaluate_and_report_settings_get_the_schemas_defaults():
    extract = cfg.stage_settings("extract", {"layer_ids": [1, 5], "target": {"path": "t"}, "server": None})
    assert extract["target"] == {"path": "t", **SECTION_DEFAULTS["target"]}
    assert {key: extract[key] for key in SECTION_DEFAULTS["extraction"]} == SECTION_DEFAULTS["extraction"]
    assert extract["server"] is None and extract["dataset"] is None and extract["last_layer"] == "final_norm"
    evaluate = cfg.stage_settings(
        "evaluate",
        {"drafter": "d", "dataset": "x", "target": {"path": "t"}, "checkpoint": {"path": "d.pt", "layer_ids": [1]}},
    )
    own = {key: value for key, value in SECTION_DEFAULTS["evaluation"].items() if key not in cfg.EVALUATION_JOB_KEYS}
    assert {key: evaluate[key] for key in own} == own
    assert not set(cfg.EVALUATION_JOB_KEYS) & set(evaluate), "how the workflow runs evaluations is no evaluate setting"
    assert evaluate["checkpoint"] == {
        "path": "d.pt",
        "layer_ids": [1],
        "layout": "auto",
        "config": None,
        "trained_with": "fla",
        "allow_pickle": False,
        "step": None,
        "last_layer": "final_norm",
    }
    assert evaluate["max_tokens"] == SECTION_DEFAULTS["fetch"]["max_tokens"]
    report = cfg.stage_settings("report", {"drafters": {"d": {}}, "datasets": ["x"]})
    assert {key: report[key] for key in SECTION_DEFAULTS["report"]} == SECTION_DEFAULTS["report"]
    assert (report["bootstrap"], report["seed"]) == (SECTION_DEFAULTS["evaluation"]["bootstrap"], 0)
    assert report["transitions"] is None


@pytest.mark.parametrize(
    ("stage", "settings"),
    [
        ("server", {"kind": "managed", "base_url": "http://h", "command": "c"}),
        ("fetch", {"dataset": "x", "prompts": "p", "tokenizer": "t", "server": {}}),
        ("extract", {"layer_ids": [1], "target": {"path": "t"}}),
        (
            "evaluate",
            {"drafter": "d", "dataset": "x", "target": {"path": "t"}, "checkpoint": {"path": "p", "layer_ids": [1]}},
        ),
        ("report", {"drafters": {}, "datasets": []}),
    ],
)
def test_an_unknown_key_is_an_error_naming_it(stage, settings):
    with pytest.raises(
        DflashEvalError, match=rf"^{stage} settings: unknown \['max_token'\] \(unknown {stage} settings"
    ):
        cfg.stage_settings(stage, {**settings, "max_token": 1})


def test_nested_unknown_keys_wrong_types_and_unknown_stages_are_named():
    with pytest.raises(
        DflashEvalError, match=r"target: Additional properties are not allowed \('colour' was unexpected\)"
    ):
        cfg.stage_settings("extract", {"layer_ids": [1], "target": {"path": "t", "colour": "red"}})
    with pytest.raises(DflashEvalError, match=r"concurrency: 'four' is not of type 'integer'"):
        cfg.stage_settings(
            "fetch", {"dataset": "x", "prompts": "p", "tokenizer": "t", "server": {}, "concurrency": "four"}
        )
    with pytest.raises(DflashEvalError, match=r"endpoint: unknown endpoint 'responses'; one of completions, chat"):
        cfg.stage_settings(
            "fetch", {"dataset": "x", "prompts": "p", "tokenizer": "t", "server": {}, "endpoint": "responses"}
        )
    with pytest.raises(DflashEvalError, match="missing \\['layer_ids'\\]"):
        cfg.stage_settings("extract", {"target": {"path": "t"}})
    with pytest.raises(DflashEvalError, match="unknown stage 'plot'"):
        cfg.stage_settings("plot", {})


def test_a_null_counts_as_left_out():
    settings = cfg.stage_settings(
        "fetch",
        {
            "dataset": "x",
            "prompts": "p",
            "tokenizer": "t",
            "server": {},
            "concurrency": None,
            "chat_template_kwargs": None,
        },
    )
    assert (
        settings["concurrency"] == SECTION_DEFAULTS["fetch"]["concurrency"] and settings["chat_template_kwargs"] == {}
    )
    with pytest.raises(DflashEvalError, match=r"missing \['server'\]"):
        cfg.stage_settings("fetch", {"dataset": "x", "prompts": "p", "tokenizer": "t", "server": None})


def test_workflow_built_settings_pass_unchanged_and_filling_is_idempotent():
    config = repo_config()
    drafter, dataset = next(iter(config["drafters"])), next(iter(config["datasets"]))
    built = {
        "server": cfg.server_settings(config),
        "fetch": fetch_settings(config, dataset),
        "extract": extract_settings(config, dataset, "L1-5"),
        "evaluate": evaluate_settings(config, drafter, dataset),
        "report": report_settings(config),
    }
    for stage, settings in built.items():
        filled = cfg.stage_settings(stage, copy.deepcopy(settings))
        assert {key: value for key, value in filled.items() if key in settings} == settings, stage
        assert all(filled[key] is None for key in set(filled) - set(settings)), stage
        assert cfg.stage_settings(stage, filled) == filled, stage


def test_cli_settings_go_through_the_same_function():
    server = {"kind": "managed", "base_url": "http://127.0.0.1:5", "command": "c"}
    args = argparse.Namespace(settings=json.dumps(server), config=None)
    assert cfg.settings_from_args(args, cfg.server_settings) == cfg.stage_settings("server", server)
    fetch = {"dataset": "x", "prompts": "p", "tokenizer": "t"}
    args = argparse.Namespace(settings=json.dumps(fetch), config=None, runtime=json.dumps({"server": server}))
    assert cfg.settings_from_args(args, fetch_settings, "dataset")["server"] == server  # runtime merged first
    with pytest.raises(TypeError, match="not one of the stage builders"):
        cfg.settings_from_args(args, dict)


def test_config_imports_no_stage_so_stage_fingerprints_hold_their_own_code():
    config_path = REPO / "src" / "dflash_eval" / "config.py"
    assert code_version._imports(config_path, config_path.read_text()) == {"drafters", "errors", "yaml_files"}
    drafters_path = REPO / "src" / "dflash_eval" / "drafters.py"
    assert code_version._imports(drafters_path, drafters_path.read_text()) == {"checkpoint", "errors", "io_utils"}
    evaluate, report = code_version.stage_modules("evaluate"), code_version.stage_modules("report")
    assert not [m for m in evaluate + report if m.startswith(("fetch.", "server."))]


def test_an_old_key_name_still_works_with_a_warning_and_both_names_are_refused(caplog):
    """evaluation.anchor_chunk was renamed blocks_per_forward: configs and hand-written settings keep working."""
    config = cfg.load_config(REPO / "config.yaml")
    raw = {key: value for key, value in yaml.safe_load((REPO / "config.yaml").read_text()).items()}
    raw["evaluation"] = {k: v for k, v in raw["evaluation"].items() if k != "blocks_per_forward"} | {"anchor_chunk": 64}
    with caplog.at_level("WARNING"):
        renamed = cfg.validate_config(raw, "old.yaml")
    assert renamed["evaluation"]["blocks_per_forward"] == 64 and "anchor_chunk" not in renamed["evaluation"]
    assert "old.yaml: evaluation.anchor_chunk is now called evaluation.blocks_per_forward" in caplog.text
    raw["evaluation"]["blocks_per_forward"] = 32
    with pytest.raises(DflashEvalError, match="anchor_chunk and evaluation.blocks_per_forward are both set"):
        cfg.validate_config(raw, "old.yaml")
    hand_written = {
        "drafter": "d",
        "dataset": "toy",
        "target": {"path": "t"},
        "max_tokens": 9,
        "anchor_chunk": 16,
        "checkpoint": {"path": "c", "layout": "auto", "trained_with": "torch"},
    }
    assert cfg.stage_settings("evaluate", hand_written)["blocks_per_forward"] == 16
    assert config["evaluation"]["blocks_per_forward"] == 512  # config.yaml uses the new name


def test_backend_comparison_names_known_drafters_and_datasets_and_needs_a_cuda_target():
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["backend_comparison"] = {"drafters": ["nope"], "datasets": ["demo-code"]}
    with pytest.raises(DflashEvalError, match=r"backend_comparison.drafters \['nope'\] are not among the drafters"):
        cfg.validate_config(raw, "c.yaml")
    raw["backend_comparison"] = {"drafters": ["demo-step60"], "datasets": ["demo-code"]}
    with pytest.raises(DflashEvalError, match="backend_comparison runs fla, which needs a CUDA target.device"):
        cfg.validate_config(raw, "c.yaml")
    raw["target"]["device"], raw["target"]["backend"] = "cuda:0", "fla"
    assert cfg.validate_config(raw, "c.yaml")["backend_comparison"]["dtypes"] == ["bfloat16", "float32"]


def test_the_gpu_demo_config_overlays_config_yaml_validly():
    """config/gpu.yaml (the README's GPU demo) on top of config.yaml: fla on cuda, the comparison asked for."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    for key, value in yaml.safe_load((REPO / "config" / "gpu.yaml").read_text()).items():
        raw[key] = {**raw.get(key, {}), **value}
    config = cfg.validate_config(raw, "config.yaml + config/gpu.yaml")
    assert (config["target"]["backend"], config["target"]["device"], config["evaluation"]["device"]) == (
        "fla",
        "cuda:0",
        "cuda",
    )
    assert config["backend_comparison"]["drafters"] == [config["report"]["served_drafter"]]
    # the GPU demo's server is config.yaml's, with replicas: the same models, the same one-request computation
    assert config["server"]["command"] == raw_cpu_command() + " --dp-size 8"
    assert config["fetch"]["concurrency"] == 8


def raw_cpu_command() -> str:
    return yaml.safe_load((REPO / "config.yaml").read_text())["server"]["command"]


def test_target_log_probs_are_stored_only_for_sampled_datasets_under_rejection():
    """The demo has a greedy and a sampled dataset: with rejection asked for, only the sampled cache stores them
    (at T 0 the scheme is target_only's, and extraction would refuse a greedy record); without it, neither."""
    config = cfg.load_config(REPO / "config.yaml")
    both = {**config, "evaluation": {**config["evaluation"], "verify": ["target_only", "rejection"]}}
    assert "target_logprobs" not in extract_params(both, "demo-code", [1, 2], "final_norm")
    assert extract_params(both, "demo-code-t07", [1, 2], "final_norm")["target_logprobs"] is True
    assert "target_logprobs" not in extract_params(config, "demo-code-t07", [1, 2], "final_norm")


def test_the_gpu_demo_leaves_profile_server_off_and_its_overlay_turns_it_back_on():
    """config/gpu.yaml keeps the first GPU run short; config/gpu_profile_server.yaml (docs/demo.md's command) after
    it restores config.yaml's profile_server settings, enabled."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    for name in ("gpu.yaml", "gpu_profile_server.yaml"):
        for key, value in yaml.safe_load((REPO / "config" / name).read_text()).items():
            raw[key] = {**raw.get(key, {}), **value}
        config = cfg.validate_config(raw, f"config.yaml + {name}")
        assert config["profile_server"]["enabled"] is (name == "gpu_profile_server.yaml")
    assert config["profile_server"]["acceptance_lengths"] == [4]
