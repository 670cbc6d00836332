"""config.yaml: loading and validation with messages that name the key, and the one way in for every stage's settings.

The settings builders live beside their stages (fetch/, extract/, evaluate/, report/settings.py; a drafter's layer
list and checkpoint directories in drafters.py), so that a stage's option is edited where the stage is. What decides a
stage's output (`fetch_params`, `extract_params`, `evaluate_settings`, `report_settings`) is a rule param, which
makes Snakemake rerun a stage when (and only when) it changes; how fetch and extract run (`fetch_runtime`,
`extract_runtime`: the server, concurrency, timeouts) reaches them as `--runtime` JSON and reruns nothing.

Every default lives in the schema, src/dflash_eval/config.schema.yaml (shipped with the package). A stage's settings
dict, however it was made (built from config.yaml, or written by hand in a test or a `--settings` JSON), goes through
`stage_settings`, which fills it from the same schema sections and checks it the same way; `settings_from_args` runs a
stage by hand with the builder it registered (`stage_builder`). This module imports no stage; no stage's code
identity (provenance/identity.py) covers it or the builders: settings reach a stage as its params.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import logging
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from dflash_eval.drafters import expand_step_directories
from dflash_eval.errors import DflashEvalError
from dflash_eval.yaml_files import read_yaml

log = logging.getLogger(__name__)

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")  # package data: found in a wheel install too


@functools.cache
def _schema() -> dict:
    """The parsed schema, once per process (callers never modify it)."""
    if not SCHEMA_PATH.exists():
        raise DflashEvalError(f"config schema {SCHEMA_PATH} not found; run from a checkout of dflash-eval")
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _fill_defaults(instance: Any, schema: dict) -> None:
    """Fill schema defaults in place, recursing into objects and maps (jsonschema does not)."""
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return
    for key, sub in schema.get("properties", {}).items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if key in instance:
            _fill_defaults(instance[key], sub)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for key, value in instance.items():
            if key not in schema.get("properties", {}):
                _fill_defaults(value, extra)


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def _message(error: jsonschema.ValidationError) -> str:
    """jsonschema's message, plus what would have been right."""
    if error.validator == "enum":
        what = error.absolute_path[-1] if error.absolute_path else "value"
        return f"unknown {what} {error.instance!r}; one of {', '.join(str(v) for v in error.validator_value)}"
    if error.validator == "additionalProperties":
        return f"{error.message} (allowed keys: {', '.join(sorted(error.schema.get('properties', {})))})"
    message = error.message
    if error.validator in ("oneOf", "anyOf") and error.context:  # say what each form wanted
        message = f"{error.instance!r} is none of the allowed forms: " + "; or ".join(
            e.message + (f" (at {_where(e)})" if e.relative_path else "") for e in error.context
        )
    if error.schema.get("description"):
        message += f" (expected: {error.schema['description']})"
    return message


def _blame(error: jsonschema.ValidationError, source: Any) -> str:
    """ " (in FILE)": the --configfile that set the key, when `source` knows (workflow.preflight.ConfigSource)."""
    if not hasattr(source, "blame"):
        return ""
    path = list(error.absolute_path)
    if error.validator == "additionalProperties":  # the unknown key itself
        path += [k for k in error.instance if k not in error.schema.get("properties", {})][:1]
    return source.blame(path)


def _schema_problems(instance: Any, schema: dict, skip_top: tuple[str, ...] = (), source: Any = None) -> list[str]:
    """Every schema violation as `key: message`, in key order; `skip_top`: top-level validators already reported."""
    errors = jsonschema.Draft202012Validator(schema).iter_errors(instance)
    kept = [e for e in errors if e.absolute_path or e.validator not in skip_top]
    return [
        f"{_where(e)}{_blame(e, source)}: {_message(e)}"
        for e in sorted(kept, key=lambda e: [str(p) for p in e.absolute_path])
    ]


# Keys users may still set under their old names: section -> {old: new}. The old name works, with a warning.
RENAMED_KEYS: dict[str, dict[str, str]] = {"evaluation": {"anchor_chunk": "blocks_per_forward"}}


def _renamed(section: str, values: dict, where: str) -> dict:
    """`values` with each old key of `section` under its new name (a warning says so); both given is an error."""
    renames = {old: new for old, new in RENAMED_KEYS.get(section, {}).items() if old in values}
    if not renames:
        return values
    values = dict(values)
    for old, new in renames.items():
        if new in values:
            raise DflashEvalError(
                f"{where}: {section}.{old} and {section}.{new} are both set; {old} is the old name "
                f"of {new}: keep only {new}"
            )
        log.warning("%s: %s.%s is now called %s.%s; it still works, but rename it", where, section, old, section, new)
        values[new] = values.pop(old)
    return values


def _moved_temperature(config: dict, source: str) -> dict:
    """fetch.temperature (greedy only, pinned to 0) became a per-dataset setting: a 0 there is dropped with a
    warning; anything else is an error that says where it goes now."""
    fetch = config.get("fetch")
    if not isinstance(fetch, dict) or "temperature" not in fetch:
        return config
    if fetch["temperature"] not in (0, 0.0):
        raise DflashEvalError(
            f"{source}: fetch.temperature is {fetch['temperature']!r}, but sampling is set per dataset "
            "now: move it to datasets.<name>.temperature (with top_p, top_k, min_p, n; docs/sampling.md)"
        )
    log.warning(
        "%s: fetch.temperature is gone (0, greedy, is the default; sampling is set per dataset: "
        "datasets.<name>.temperature); remove it",
        source,
    )
    return {**config, "fetch": {k: v for k, v in fetch.items() if k != "temperature"}}


def validate_config(config: dict, source: str = "config.yaml") -> dict:
    """Validate against the schema, fill defaults, then check what a schema cannot express."""
    schema = _schema()
    config = {key: _renamed(key, value, source) if isinstance(value, dict) else value for key, value in config.items()}
    config = _moved_temperature(config, source)
    problems = _schema_problems(config, schema, source=source)
    if problems:
        raise DflashEvalError(f"{source} is not valid:\n" + "\n".join(f"  {line}" for line in problems))
    config = copy.deepcopy(config)
    _fill_defaults(config, schema)
    config["drafters"] = expand_step_directories(config["drafters"], source)
    _check_semantics(config, source)
    return config


def _check_semantics(config: dict, source: str) -> None:
    problems = _server_problems(config["server"])
    if problems:
        raise DflashEvalError(f"{source}: " + "; ".join(problems))
    if config["target"]["backend"] == "fla" and config["target"]["device"] == "cpu":
        raise DflashEvalError(
            f"{source}: target.backend fla cannot run on target.device cpu (Triton kernels need CUDA); "
            "use a cuda device, or backend torch (and then set trained_with accordingly)"
        )
    for name, spec in config["datasets"].items():
        _check_dataset(name, spec, source)
    for key, names in (("only", config["drafters"]), ("only_datasets", config["datasets"])):
        select(config.get(key), list(names), f"{source}: {key}")
    comparison = config["backend_comparison"]
    for key, names in (("drafters", config["drafters"]), ("datasets", config["datasets"])):
        unknown = [name for name in comparison[key] if name not in names]
        if unknown:
            raise DflashEvalError(
                f"{source}: backend_comparison.{key} {unknown} are not among the {key}: {', '.join(names)}"
            )
    if comparison["drafters"] and comparison["datasets"] and not config["target"]["device"].startswith("cuda"):
        raise DflashEvalError(
            f"{source}: backend_comparison runs fla, which needs a CUDA target.device "
            f"(it is {config['target']['device']}); set target.device: cuda:0, or empty the lists"
        )
    for key in ("reference", "served_drafter"):
        name = config["report"][key]
        if name is not None and name not in config["drafters"]:
            raise DflashEvalError(
                f"{source}: report.{key} {name!r} is not one of the drafters: {', '.join(config['drafters'])}"
            )


def preset_names() -> list[str]:
    """The named prompt sets (fetch/presets.py loads them; a test keeps the two lists equal)."""
    return list(_dataset_properties()["preset"]["enum"])


def _check_dataset(name: str, spec: dict, source: str) -> None:
    """A dataset is a prompt file or a named preset (its local copy optional): exactly one, named."""
    key = f"{source}: datasets.{name}"
    if ("prompts" in spec) == ("preset" in spec):
        raise DflashEvalError(
            f"{key}: give either prompts (a JSONL prompt file) or preset (one of "
            f"{', '.join(preset_names())}), not both or neither"
        )
    for extra in ("source", "cache_dir"):
        if spec.get(extra) is not None and "preset" not in spec:
            raise DflashEvalError(f"{key}.{extra} only goes with preset (the local copy of a named set); remove it")
    problems = sampling_problems(spec)
    if problems:
        raise DflashEvalError(f"{key}: " + "; ".join(problems))


# A dataset's sampling keys with their "off" values (SGLang's: top_k -1, top_p 1.0, min_p 0.0): at temperature 0
# any other value would be silently ignored by a greedy server, so it is refused.
SAMPLING_OFF = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1}
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "sampling_seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def dataset_samples(spec: dict) -> bool:
    """Whether a dataset's completions are sampled (temperature > 0); greedy otherwise."""
    return float(spec.get("temperature") or 0.0) > 0


def sampling_problems(spec: dict) -> list[str]:
    """What a dataset's sampling settings (already filled with defaults) cannot be: sampling keys at temperature 0."""
    if dataset_samples(spec):
        return []
    given = {key: spec[key] for key, off in SAMPLING_OFF.items() if spec.get(key, off) != off}
    if not given:
        return []
    return [
        f"{', '.join(f'{k}={v!r}' for k, v in given.items())} at temperature 0 (greedy): a greedy server ignores "
        "them and n > 1 would fetch the same completion n times; set temperature > 0 (what you serve), or remove them"
    ]


def load_config(path: str | Path) -> dict:
    """Read and validate a config.yaml."""
    path = Path(path)
    if not path.exists():
        raise DflashEvalError(f"config file {path} not found")
    return validate_config(read_yaml(path) or {}, str(path))


# -- selections ------------------------------------------------------------------------------


def select(patterns: Any, names: list[str], what: str) -> list[str]:
    """Names matching `--config only=...`: a list or comma-separated names or shell patterns.

    A directory drafter's own name selects all its steps. None selects everything.
    """
    if patterns is None:
        return names
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()]
    chosen: list[str] = []
    for pattern in (str(p).strip() for p in patterns):
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern) or n.rsplit("-step", 1)[0] == pattern]
        if not matched:
            raise DflashEvalError(f"{what}: {pattern!r} matches none of: {', '.join(names)}")
        chosen += [n for n in matched if n not in chosen]
    return [n for n in names if n in chosen]


def setting_default(section: str, key: str) -> Any:
    """The schema's default of `<section>.<key>`, for code that runs without a config (benchmarks, tests): the one
    place a setting's default is written."""
    return _properties(section)[key]["default"]


def drafter_default(key: str) -> Any:
    """The schema's default of a drafter setting (`drafters.<name>.<key>`), for code that runs without a config."""
    return _schema()["properties"]["drafters"]["additionalProperties"]["properties"][key]["default"]


# -- stage settings: built from config.yaml, or written by hand; filled and checked here -------

NAME = {"type": "string", "minLength": 1}
LAYER_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
CHECKPOINT_KEYS = (
    "path",
    "layout",
    "config",
    "trained_with",
    "allow_pickle",
    "step",
)  # + layer_ids, last_layer: resolved
STAGES = ("server", "fetch", "extract", "evaluate", "report", "profile_server")


def _properties(section: str) -> dict:
    return _schema()["properties"][section]["properties"]


def _dataset_properties() -> dict:
    return _schema()["properties"]["datasets"]["additionalProperties"]["properties"]


# extract's own key, derived from evaluation.verify (extract.settings.extract_params): store the target's log-probs
TARGET_LOGPROBS = {
    "type": "boolean",
    "description": "store the target's sampled log-probability of each completion token (rejection); absent: no",
}


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": list(required)}


# evaluation keys that say how the workflow runs the evaluations (its jobs), not what one computes: no evaluate
# setting, so changing them changes no evaluation's settings param nor its result-store key
EVALUATION_JOB_KEYS = ("checkpoints_per_job",)


@functools.cache
def stage_schema(stage: str) -> dict:
    """The schema of one stage's settings dict, made of config.schema.yaml's own key schemas and defaults.

    Only the keys that name a run's inputs (dataset, drafter, tokenizer, the layer ids) and the server
    (runtime, checked by the server stage itself) are the stage's own; every other key is the config's.
    """
    if stage not in STAGES:
        raise DflashEvalError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    top = _schema()["properties"]
    fetch, evaluation = _properties("fetch"), _properties("evaluation")
    drafter = top["drafters"]["additionalProperties"]["properties"]
    target_path = _properties("target")["path"]
    server = {"type": "object", "description": "server settings (see the server section)"}
    if stage == "server":
        return top["server"]
    if stage == "profile_server":  # dflash-eval profile-server: the server it restarts and how it times it
        return _object({"server": server, **_properties("profile_server")}, required=("server",))
    if stage == "fetch":
        return _object(
            {"dataset": NAME, "tokenizer": target_path, "server": server, **_dataset_properties(), **fetch},
            required=("dataset", "server", "tokenizer"),
        )
    if stage == "extract":
        return _object(
            {
                "dataset": NAME,
                "layer_ids": LAYER_IDS,
                "last_layer": drafter["last_layer"],
                "target": top["target"],
                **_properties("extraction"),
                "server": server,
                "target_logprobs": TARGET_LOGPROBS,
            },
            required=("layer_ids", "target"),
        )
    if stage == "evaluate":
        # layer_ids as config.yaml's drafters have it: null (or left out) means the checkpoint's own list
        checkpoint = _object(
            {key: drafter[key] for key in (*CHECKPOINT_KEYS, "layer_ids", "last_layer")}, required=("path",)
        )
        return _object(
            {
                "drafter": NAME,
                "dataset": NAME,
                "checkpoint": checkpoint,
                "target": _object({"path": target_path}, required=("path",)),
                "max_tokens": fetch["max_tokens"],
                "speedup": {  # the drafter's timing; not the profile
                    **top["speedup"],
                    "properties": {
                        key: value for key, value in top["speedup"]["properties"].items() if key != "profile"
                    },
                },
                **{key: value for key, value in evaluation.items() if key not in EVALUATION_JOB_KEYS},
            },
            required=("drafter", "dataset", "checkpoint", "target"),
        )
    names = {"type": "array", "items": NAME}
    return _object(
        {
            "drafters": {"type": "object"},
            "drafter_order": names,
            "datasets": names,
            "dataset_prompts": {"type": "object", "additionalProperties": {"type": "string"}},
            **_properties("report"),
            "transitions": {"type": "string"},
            "bootstrap": evaluation["bootstrap"],
            "seed": evaluation["seed"],
        }
    )


def _without_nulls(instance: Any, schema: dict) -> Any:
    """A null value means "the default" in settings written by hand: drop it, in objects the schema describes."""
    if not isinstance(instance, dict) or "properties" not in schema:
        return instance
    return {
        key: _without_nulls(value, schema["properties"].get(key, {}))
        for key, value in instance.items()
        if value is not None
    }


def stage_settings(stage: str, settings: dict) -> dict:
    """One stage's settings, filled with the schema's defaults and checked: unknown and missing keys, types, and
    the rules between keys. The one way in for every settings dict, workflow-built or hand-written; idempotent.

    Every key of the stage is in the result (an optional one without a default as None); a None given counts as
    left out, so it gets the default.
    """
    schema = stage_schema(stage)
    out = _without_nulls(
        copy.deepcopy(_renamed({"evaluate": "evaluation"}.get(stage, stage), settings, f"{stage} settings")), schema
    )
    missing = [key for key in schema["required"] if key not in out]
    unknown = sorted(set(out) - set(schema["properties"]))
    problems = []
    if missing or unknown:
        keys = ", ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []))
        if unknown:
            keys += (
                f" (unknown {stage} settings are refused, so that a typo is loud; the known ones: "
                f"{', '.join(sorted(schema['properties']))})"
            )
        problems.append(keys)
    _fill_defaults(out, schema)
    problems += _schema_problems(out, schema, skip_top=("required", "additionalProperties"))
    problems += {"server": _server_problems, "fetch": _fetch_problems}.get(stage, lambda _: [])(out)
    if problems:
        raise DflashEvalError(f"{stage} settings: " + "; ".join(problems))
    for key in schema["properties"]:  # the stage reads every key: an optional one without a default is None
        out.setdefault(key, None)
    if stage == "server":
        out["base_url"] = str(out["base_url"]).rstrip("/")
    return out


def _server_problems(server: dict) -> list[str]:
    """What each server kind needs besides the schema (config.yaml's server section and the server stage alike)."""
    kind, start, stop = server.get("kind"), server.get("start_command"), server.get("stop_command")
    if kind == "managed" and not server.get("command"):
        return ["server.command is required for kind: managed (the command that launches the server)"]
    if kind == "external" and not (start and stop):
        return ["server.start_command and server.stop_command are required for kind: external"]
    if kind == "release" and bool(start) != bool(stop):
        return [
            "kind: release takes server.start_command and server.stop_command together (the fallback when "
            "releasing does not free the GPU), or neither"
        ]
    return []


def _fetch_problems(settings: dict) -> list[str]:
    if ("prompts" in settings) == ("preset" in settings):
        return [
            f"give exactly one of prompts (a file) and preset (a named set), got prompts={settings.get('prompts')!r}, "
            f"preset={settings.get('preset')!r}"
        ]
    return sampling_problems(settings)


def server_settings(config: dict) -> dict:
    return dict(config["server"])


def verify_schemes(verify: str | list[str] | None) -> list[str]:
    """evaluation.verify as a list: one scheme or several (the schema's default when None)."""
    if verify is None:
        verify = _properties("evaluation")["verify"]["default"]
    return [verify] if isinstance(verify, str) else list(verify)


def prompt_set(spec: dict) -> str:
    """Which prompts a dataset draws from (its file, or its preset and local copy): datasets of one prompt set at
    several temperatures are one family, the report's tau against temperature."""
    if spec.get("prompts"):
        return f"prompts {Path(spec['prompts']).as_posix()}"
    return f"preset {spec['preset']}" + (f" ({Path(spec['source']).as_posix()})" if spec.get("source") else "")


def profile_server_settings(config: dict) -> dict:
    return {"server": server_settings(config), **config["profile_server"]}


# the builder of each stage's settings from config.yaml, for settings_from_args; a builder that lives beside its
# stage (fetch/, extract/, evaluate/, report/settings.py) registers itself with stage_builder
_BUILDERS = {
    server_settings: "server",
    profile_server_settings: "profile_server",
}


def stage_builder(stage: str) -> Any:
    """Register a settings builder that lives beside its stage, so that `settings_from_args` takes it."""

    def register(build: Any) -> Any:
        _BUILDERS[build] = stage
        return build

    return register


def settings_json(settings: dict) -> str:
    """Canonical JSON, so equal settings compare equal as Snakemake params."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


RUNTIME_HELP = (
    "how the stage runs, as JSON (the server; for fetch also its concurrency, timeout, retries and backoff): the workflow "
    "passes it beside --settings, so that changing it reruns nothing"
)


def with_runtime(settings: dict, runtime: str | None) -> dict:
    """`settings` with the workflow's `--runtime JSON` (how the stage runs; see fetch_runtime) merged in."""
    if not runtime:
        return settings
    try:
        return {**settings, **json.loads(runtime)}
    except json.JSONDecodeError as error:
        raise DflashEvalError(f"--runtime is not valid JSON ({error})") from error


def settings_from_args(args: Any, build: Any, *selectors: str) -> dict:
    """Settings for a CLI stage: `--settings JSON` as the workflow passes it, or `--config` + selectors (built by
    `build`, one of the `*_settings` functions above); then `--runtime`, then stage_settings."""
    stage = _BUILDERS.get(build)
    if stage is None:
        raise TypeError(
            f"settings_from_args: {build!r} is not one of the stage builders (dflash_eval.config's, or "
            "one registered with config.stage_builder)"
        )
    if getattr(args, "settings", None):
        text = args.settings
        if not text.lstrip().startswith("{") and Path(text).is_file():
            text = Path(text).read_text()
        try:
            settings = json.loads(text)
        except json.JSONDecodeError as error:
            raise DflashEvalError(f"--settings is not valid JSON ({error})") from error
    elif not getattr(args, "config", None):
        raise DflashEvalError("give --settings JSON (as the workflow does) or --config config.yaml with the selectors")
    else:
        config = load_config(args.config)
        values = []
        for selector in selectors:
            value = getattr(args, selector, None)
            if value is None:
                raise DflashEvalError(f"--{selector} is required with --config")
            named = selector in ("dataset", "drafter")  # a key of config.yaml, not a value such as --layers
            values.append(configured_name(config, selector, value, args.config) if named else value)
        settings = build(config, *values)
    return stage_settings(stage, with_runtime(settings, getattr(args, "runtime", None)))


def configured_name(config: dict, selector: str, name: str, source: str) -> str:
    """`name` when the config has such a dataset or drafter (`selector`), else an error listing those it has."""
    section = f"{selector}s"
    if name not in config[section]:
        raise DflashEvalError(
            f"--{selector} {name!r}: {source} has no such entry under {section}; one of: {', '.join(config[section])}"
        )
    return name
