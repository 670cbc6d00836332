# Helpers shared by the rules: the path of every file that passes between stages, settings as params,
# input files of targets and checkpoints.
import functools
import os
from pathlib import Path

from dflash_eval import config as cfg
from dflash_eval.drafters import (
    drafter_last_layer,
    drafter_layer_ids,
    layerset_last_layer,
    layerset_name,
    parse_layerset,
)
from dflash_eval.evaluate.settings import evaluate_settings
from dflash_eval.extract.settings import extract_params, extract_runtime
from dflash_eval.fetch.settings import dataset_inputs, fetch_params, fetch_runtime
from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch.prompts import load_prompts, order_free_digest
from dflash_eval.report.plots import PLOTS
from dflash_eval.report.settings import report_settings
from dflash_eval.provenance.identity import stage_identity
from dflash_eval.provenance.fingerprint import FingerprintCache
from dflash_eval.io_utils import sha256_file
from dflash_eval.speedup import validation
from dflash_eval.cache.serving_profile import load_profile
from dflash_eval.tools import profile_server as server_profile
from dflash_eval.tools import profile_target as target_profile

RESULTS = "results"
# the packaged validation record the summary quotes (speedup/validation.py): a new one reruns the report
VALIDATION_RECORD = sha256_file(validation.RECORD)
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
DEMO_DIR = "resources/demo"
DEMO = config["demo"]

# What passes between the stages (docs/contracts.md), named once; every rule file uses these.
COMPLETIONS = (
    f"{RESULTS}/completions/{{dataset}}.jsonl"  # fetch -> extract, evaluate, report
)
HIDDEN = f"{RESULTS}/hidden/{{dataset}}/{{layerset}}"  # extract -> evaluate, report
METRICS = f"{RESULTS}/eval/{{drafter}}/{{dataset}}/metrics.json"  # evaluate -> report
BACKENDS = f"{RESULTS}/backends/{{drafter}}/{{dataset}}/{{dtype}}.json"  # compare_backends -> report
SAMPLES = f"{RESULTS}/eval/{{drafter}}/{{dataset}}/samples.csv"  # evaluate -> report
PROFILE = f"{RESULTS}/eval/{{drafter}}/{{dataset}}/speculation_profile.json"  # export (report.smk)
RECORD = f"{RESULTS}/eval/{{drafter}}/{{dataset}}/record.json"  # export (report.smk)
SERVER_PROFILE = f"{RESULTS}/server_profile.json"  # profile_server -> report (opt-in)
# The target's serving step for the expected speedup, one per target, device, dtype and backend: profile_target ->
# report (profile.smk), when speedup.measure times it; the user's speedup.profile instead, checked now (a bad field
# stops the run before any job). Either is an input of the report alone: a change reruns no evaluation.
USER_PROFILE = config["speedup"]["profile"]
if USER_PROFILE:
    load_profile(USER_PROFILE)
TARGET_PROFILE = (
    target_profile.profile_path(config, RESULTS)
    if target_profile.wanted(config)
    else None
)


def code_prefix(stage: str, engine: str = "auto") -> str:
    """The stage's code identity at the head of its rule's shell command: Snakemake's own `code` rerun trigger compares
    a rule's shell command, so a change of the code that decides the stage's outputs reruns it (not a param: a
    campaign pins its code with `--rerun-triggers mtime params input software-env`, settings still counting).
    The stage reads it as DFLASH_EVAL_CODE to tell whether it runs the code that was planned (docs/reruns.md).
    `engine`: fetch's server.engine, whose own code decides the records (provenance.identity.FETCH_ENGINES).
    """
    return f"DFLASH_EVAL_CODE={stage_identity(stage, engine)} "


def settings_param(settings: dict) -> str:
    """Stage settings as one canonical JSON param: one value, so Snakemake tracks it as a whole."""
    return cfg.settings_json(settings)


# How fetch and extract run (server, concurrency, timeouts), as opposed to what they produce: not params,
# so Snakemake reruns nothing when they change. Their shell commands read it from these environment variables
# (`--runtime "$DFLASH_EVAL_FETCH_RUNTIME"`), set by every Snakemake process that parses this file, cluster jobs
# included. See config.fetch_runtime.
os.environ.update(
    DFLASH_EVAL_FETCH_RUNTIME=cfg.settings_json(fetch_runtime(config)),
    DFLASH_EVAL_EXTRACT_RUNTIME=cfg.settings_json(extract_runtime(config)),
)


def model_dir_files(path: str, demo_files: list[str]) -> list[str]:
    """Files of a model directory that a rule depends on (content-tracked, not the directory mtime).

    Demo models do not exist until the demo rules build them, so their file names are known here.
    """
    root = Path(path)
    if root.is_dir() and any(root.glob("*.safetensors")):
        names = sorted({p.name for p in root.glob("*.safetensors")} | {"config.json"})
        names += [
            n
            for n in ("model.safetensors.index.json", "generation_config.json")
            if (root / n).exists()
        ]
        return [str(root / n) for n in dict.fromkeys(names)]
    if DEMO["enabled"] and path.startswith(DEMO_DIR):
        return [f"{path}/{name}" for name in demo_files]
    why = unbuilt_demo(path)
    raise ValueError(
        f"{path}: not a model directory with safetensors weights (check target.path / drafters.*.path"
        f"{f'; {why}' if why else ''})"
    )


def unbuilt_demo(path: str) -> str:
    """Why a demo model path is missing when the demo's rules are off ("" for any other path)."""
    if DEMO["enabled"] or not str(path).startswith(DEMO_DIR):
        return ""
    return "the workflow builds the demo's models only with demo.enabled: true"


# Model files that a rule of this workflow builds (the demo) are inputs, so the DAG orders their
# build first; every other model file is tracked by a content fingerprint param, hashed once and
# cached by path, size and mtime (see dflash_eval/provenance/fingerprint.py for why not Snakemake's checksums).
FINGERPRINTS = FingerprintCache()


def built_here(files: list[str]) -> bool:
    return DEMO["enabled"] and all(f.startswith(f"{DEMO_DIR}/") for f in files)


@functools.cache
def target_files() -> tuple[str, ...]:
    """Listed once per Snakemake process: every fetch, extract and evaluate job asks (500+ at scale)."""
    return tuple(
        model_dir_files(
            config["target"]["path"],
            ["config.json", "model.safetensors", "generation_config.json"],
        )
    )


def target_inputs(wildcards=None) -> list[str]:
    files = target_files()
    return list(files) if built_here(files) else []


def served_drafter_inputs(wildcards=None) -> list[str]:
    """The served drafter's files when the demo builds them: the demo's server loads it, so fetch waits for it."""
    name = (config.get("report") or {}).get("served_drafter")
    return checkpoint_inputs(name) if name in config.get("drafters", {}) else []


def target_fingerprint(wildcards=None) -> str:
    return _target_fingerprint()


@functools.cache
def _target_fingerprint() -> str:
    files = list(target_files())
    return (
        "built by the workflow"
        if built_here(files)
        else FINGERPRINTS.files(files, "target.path")
    )


@functools.cache
def prompts_fingerprint(dataset: str) -> str:
    """A prompt file's prompts as a set (fetch's param instead of the file's mtime: its order reruns nothing)."""
    spec = config["datasets"][dataset]
    if "prompts" not in spec:
        return ""
    return order_free_digest(load_prompts(spec["prompts"]))


def selected_evaluations() -> list[str]:
    """`--config only=... only_datasets=...`: just these evaluations, no report."""
    drafters = cfg.select(config.get("only"), list(config["drafters"]), "--config only")
    datasets = cfg.select(
        config.get("only_datasets"), list(config["datasets"]), "--config only_datasets"
    )
    return expand(METRICS, drafter=drafters, dataset=datasets)


def checkpoint_inputs(name: str) -> list[str]:
    files = checkpoint_files(name)
    return list(files) if built_here(files) else []


@functools.cache  # per drafter, not per evaluation job
def checkpoint_fingerprint(name: str) -> str:
    files = list(checkpoint_files(name))
    return (
        "built by the workflow"
        if built_here(files)
        else FINGERPRINTS.files(files, f"drafters.{name}.path")
    )


@functools.cache  # per drafter: its input and its fingerprint param both ask, for every dataset
def checkpoint_files(name: str) -> tuple[str, ...]:
    spec = config["drafters"][name]
    path = spec["path"]
    if path.endswith((".pt", ".pth", ".safetensors", ".bin", ".ckpt")):
        files = [path]
    else:
        files = model_dir_files(path, ["config.json", "model.safetensors"])
    if spec.get("config"):
        config_path = spec["config"]
        files.append(
            config_path
            if config_path.endswith(".json")
            else f"{config_path}/config.json"
        )
    return tuple(files)


def drafter_layerset(name: str) -> str:
    return layerset_name(
        drafter_layer_ids(config, name), drafter_last_layer(config, name)
    )


def hidden_cache(drafter: str, dataset: str) -> str:
    """The cache an evaluation reads: its dataset's states at the drafter's layer set."""
    return HIDDEN.format(dataset=dataset, layerset=drafter_layerset(drafter))


def report_caches(wildcards=None) -> list[str]:
    """Every hidden-state cache an evaluation read: the trust panel lists their provenance."""
    return sorted(
        {
            hidden_cache(drafter, dataset)
            for drafter in config["drafters"]
            for dataset in config["datasets"]
        }
    )


def checked_report_settings(wildcards=None) -> str:
    """The report's settings, asked once each evaluation it reads exists or can be made.

    With an older report present, Snakemake plans the report even when an evaluation cannot be made
    (a drafter path that holds no model: the evaluate rule's input error is not shown), and the job
    then fails on its missing inputs with a misleading "filesystem latency" message. A param's error
    stops the run while it is planned, before any job starts, naming the cause.
    """
    for drafter in config["drafters"]:
        for dataset in config["datasets"]:
            metrics = METRICS.format(drafter=drafter, dataset=dataset)
            if Path(metrics).exists():
                continue
            try:  # what the evaluate rule's inputs need (see evaluate.smk)
                checkpoint_inputs(drafter)
                target_inputs()
            except (ValueError, DflashEvalError) as error:
                raise DflashEvalError(
                    f"the report needs {metrics} (drafter {drafter!r} on dataset {dataset!r}), "
                    f"which does not exist and cannot be made: {error}"
                ) from None
    return settings_param(report_settings(config))


def report_output(path: str, caption: str, category: str):
    return report(update(path), caption=f"../report/{caption}", category=category)


# The report's outputs in one dict, the summary first (snakefmt would move a `**` unpacking in the rule before the
# named outputs; the summary.csv names the job in Snakemake's output), then every registered plot.
REPORT_OUTPUTS = {
    "csv": report_output(f"{RESULTS}/summary.csv", "summary_csv.rst", "Summary"),
    "md": report_output(f"{RESULTS}/summary.md", "summary_md.rst", "Summary"),
    "trust": report_output(f"{RESULTS}/trust.json", "trust.rst", "Summary"),
    **{
        name: report_output(f"{RESULTS}/plots/{plot.file}", plot.caption, "Plots")
        for name, plot in PLOTS.items()
    },
}


def plot_dir(wildcards, output) -> str:
    """The plots' folder, from their declared outputs: the stage writes every registered plot there."""
    return str(Path(getattr(output, next(iter(PLOTS)))).parent)


def backend_comparisons(wildcards=None) -> list[str]:
    """The compare_backends outputs that config.yaml's backend_comparison asks for (none by default)."""
    wanted = config["backend_comparison"]
    return expand(
        BACKENDS,
        drafter=wanted["drafters"],
        dataset=wanted["datasets"],
        dtype=wanted["dtypes"],
    )


def report_intermediates() -> list[str]:
    """Every file and cache the report is made from (the report rule's inputs, resolved), and each evaluation's export."""
    drafters, datasets = list(config["drafters"]), list(config["datasets"])
    return [
        *expand(COMPLETIONS, dataset=datasets),
        *report_caches(),
        *expand(METRICS, drafter=drafters, dataset=datasets),
        *expand(SAMPLES, drafter=drafters, dataset=datasets),
        *expand([PROFILE, RECORD], drafter=drafters, dataset=datasets),
        *backend_comparisons(),
        *server_profile_inputs(),  # a missing server_profile.json is rebuilt by a plain run, as the rest is
        *target_profile_inputs(),
    ]


def evaluation_groups() -> dict[str, list[str]]:
    """evaluation.checkpoints_per_job > 1: the drafters, per layer set in config order, in runs of that many;
    each group is one evaluation job per dataset, named by its first drafter (docs/running.md).
    """
    size = config["evaluation"]["checkpoints_per_job"]
    by_layerset: dict[str, list[str]] = {}
    for name in config["drafters"]:
        by_layerset.setdefault(drafter_layerset(name), []).append(name)
    return {
        names[i]: names[i : i + size]
        for names in by_layerset.values()
        for i in range(0, len(names), size)
    }


def evaluation_member(drafter: str, dataset: str) -> str:
    """One checkpoint of a grouped evaluation job, as its `--member` JSON: its settings and its two outputs."""
    return cfg.settings_json(
        {
            "settings": evaluate_settings(config, drafter, dataset),
            "metrics": METRICS.format(drafter=drafter, dataset=dataset),
            "samples": SAMPLES.format(drafter=drafter, dataset=dataset),
        }
    )


# profile.smk, opt-in: its load-time checks, and how the report takes its file.
_profile_problems = server_profile.problems(config)
if _profile_problems:
    raise DflashEvalError(f"{CONFIG_SOURCE}: " + "; ".join(_profile_problems))


def server_profile_inputs(wildcards=None) -> list[str]:
    """The report's profile-server input: the file when profile_server.enabled, else none."""
    return [SERVER_PROFILE] if config["profile_server"]["enabled"] else []


def server_profile_arg(wildcards, input) -> str:
    return f"--server-profile {input.server_profile}" if input.server_profile else ""


def target_profile_inputs(wildcards=None) -> list[str]:
    """The report's target profile: the user's speedup.profile, else profile_target's file when it runs, else none."""
    if USER_PROFILE:
        return [USER_PROFILE]
    return [TARGET_PROFILE] if TARGET_PROFILE else []


def target_profile_arg(wildcards, input) -> str:
    if not input.target_profile:
        return ""
    flag = "--user-profile" if USER_PROFILE else "--target-profile"
    return f"{flag} {input.target_profile}"


def drafter_config_inputs(wildcards=None) -> list[str]:
    """The drafters' config.json files the workflow builds (the demo's): profile_target reads their block sizes."""
    return [
        f
        for name in config["drafters"]
        for f in checkpoint_inputs(name)
        if f.endswith("config.json")
    ]
