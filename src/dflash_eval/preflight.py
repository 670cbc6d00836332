"""What the Snakefile calls when the workflow loads: the config's sources, and every input the config names,
checked before any job runs or deletes anything.

Snakemake decides what to run from file times and params. Without this, a path that went missing,
or a checkpoint that contradicts its settings, is found only by the job that reads it: after
Snakemake has removed that job's old outputs, perhaps after hours of extraction, or never, when the
results already exist ("Nothing to be done" over stale numbers). What decides it is cheap to read
(config.json files, safetensors headers, the prompt files), so it is read at every start, and every
problem found is listed at once, each with its key and path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

from dflash_eval.cache import manifest as cache_manifest
from dflash_eval.cache.verify import changed_since_extraction, repair_command
from dflash_eval.checkpoint import check_checkpoint, checkpoint_facts
from dflash_eval.config import dataset_samples, select, verify_schemes
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import drafter_kind
from dflash_eval.extract.layers import check_layer_ids
from dflash_eval.fetch.prompts import load_prompts
from dflash_eval.methods import REJECTION, TARGET_ONLY
from dflash_eval.target_identity import check_target_dir, cuda_build_problem
from dflash_eval.yaml_files import read_yaml

_MAX_LISTED = 20  # a step directory of 100 checkpoints with one wrong setting is one problem 100 times


class ConfigSource(str):
    """The label of a merged config ("config.yaml + run.yaml + --config"), which also knows, for a key,
    the file that set it: Snakemake merges config.yaml, each --configfile and --config in that order."""

    layers: list[tuple[str, Any]]

    def __new__(cls, layers: list[tuple[str, Any]]) -> Self:
        label = super().__new__(cls, " + ".join(name for name, _ in layers) or "config")
        label.layers = layers
        return label

    def blame(self, path: list[Any]) -> str:
        """ " (in FILE)" for the last source that sets `path`, when there is more than one source."""
        if len(self.layers) < 2:
            return ""
        for name, data in reversed(self.layers):
            for key in path:
                if not isinstance(data, dict) or key not in data:
                    break
                data = data[key]
            else:
                return f" (in {name})"
        return ""


def check_yaml_before_snakemake(path: str | Path) -> None:
    """Read the Snakefile's own config file strictly before its `configfile:` directive does: for a tab or any
    other syntax error Snakemake says only "Config file is not valid JSON or YAML", naming no file and no line;
    read_yaml names the file, line and column and the fix. (A --configfile Snakemake reads before the Snakefile
    runs, where no workflow code can name it: docs/running.md.)"""
    if Path(path).is_file():
        read_yaml(path)


def config_source(configfiles: Iterable[Any], cli_files: Iterable[Any], overrides: Any) -> ConfigSource:
    """The sources of the config Snakemake built, lowest precedence first: the Snakefile's `configfile:`,
    then each --configfile, then --config (the Snakefile passes workflow.configfiles and its settings).
    Each file is read again strictly: a key repeated in one mapping is an error naming the file and lines."""
    cli = [Path(f) for f in cli_files]
    directive = [Path(f) for f in configfiles if Path(f).resolve() not in {c.resolve() for c in cli}]
    layers: list[tuple[str, Any]] = []
    for file in [*directive, *cli]:
        data = read_yaml(file) or {}  # Snakemake read it last-wins: a repeated key is refused here
        relative = os.path.relpath(file)
        layers.append((str(file.absolute()) if relative.startswith("..") else relative, data))
    if overrides:
        layers.append(("--config", dict(overrides)))
    return ConfigSource(layers)


def built_by(outputs: Iterable[str]) -> Callable[[str], bool]:
    """Whether a path is one that a rule of the workflow writes (a declared output, or a directory of
    them: the demo's models): such a path need not exist when the workflow loads."""
    files = {os.path.normpath(str(o)) for o in outputs}
    dirs = {os.path.dirname(f) for f in files}
    dirs |= {os.path.dirname(d) for d in dirs}  # one level up too: resources/demo/drafters/<name>/... -> drafters

    def built(path: str) -> bool:
        path = os.path.normpath(path)
        return path in files or path in dirs

    return built


def check_inputs(
    config: dict[str, Any],
    source: str,
    built: Callable[[str], bool] = lambda path: False,
    why_missing: Callable[[str], str] = lambda path: "",
) -> None:
    """Raise one error listing every missing path and contradiction in a validated config; `why_missing`
    may explain a missing path (the Snakefile's: a demo model while the demo's rules are off)."""
    problems: list[str] = []

    def blame(key: str) -> str:
        return source.blame(key.split(".")) if isinstance(source, ConfigSource) else ""

    def attempt(key: str, check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except DflashEvalError as error:
            problems.append(f"  {key}{blame(key)}: {error}")
            return None

    def present(key: str, path: str | None) -> bool:
        """Whether `path` can be read now; a missing one is a problem unless a rule builds it."""
        if path is None or built(path) and not Path(path).exists():
            return False
        if not Path(path).exists():
            why = why_missing(path)
            problems.append(
                f"  {key}{blame(key)}: {path} does not exist{f' ({why})' if why else ''}; fix the path "
                "(or create the file) before running"
            )
            return False
        return True

    target = config["target"]
    text = attempt("target.path", check_target_dir, target["path"]) if present("target.path", target["path"]) else None
    for key, device in (("target.device", target["device"]), ("evaluation.device", config["evaluation"]["device"])):
        problem = cuda_build_problem(device, key)  # starts with the key
        if problem:
            problems.append(f"  {key}{blame(key)}{problem[len(key) :]}")
    for name, spec in config["datasets"].items():
        if present(f"datasets.{name}.prompts", spec.get("prompts")):
            attempt(f"datasets.{name}.prompts", load_prompts, spec["prompts"])
        present(f"datasets.{name}.source", spec.get("source"))
    unusable: list[str] = []  # drafters whose checkpoint cannot be evaluated as it is
    chosen = set(select(config.get("only"), list(config["drafters"]), "only"))  # `--config only=`: the rest never runs
    for name, spec in config["drafters"].items():
        if name not in chosen:
            continue
        key = f"drafters.{name}"
        listed = len(problems)
        readable = [present(f"{key}.{field}", spec[field]) for field in ("path", "config") if spec.get(field)]
        if all(readable):
            attempt(key, _check_drafter, spec, text)
        if len(problems) > listed:
            unusable.append(name)
        if spec["trained_with"] != target["backend"] and not config["evaluation"]["allow_backend_mismatch"]:
            problems.append(
                f"  {key}.trained_with{blame(key + '.trained_with')}: {spec['trained_with']}, but target.backend is {target['backend']}: the evaluation "
                "would refuse this drafter's cache after its extraction. Extract with the backend it was trained with "
                "(target.backend), or set evaluation.allow_backend_mismatch: true to evaluate anyway (flagged)"
            )
    problems += [f"  {key}{blame(key)}: {why}" for key, why in verify_problems(config)]
    problems += [f"  {key}{blame(key)}: {why}" for key, why in drafter_kind.sampled_problems(config, _architecture)]
    for warning in _load_warnings(config, text):
        sys.stderr.write(f"WARNING: {source}: {warning}\n")
    if problems:
        shown = problems[:_MAX_LISTED] + (
            [f"  ... and {len(problems) - _MAX_LISTED} more"] if len(problems) > _MAX_LISTED else []
        )
        others = [name for name in config["drafters"] if name not in unusable]
        if unusable and others and len(unusable) == len(problems):  # only checkpoints: the rest can run meanwhile
            shown.append(
                f"To evaluate the other drafters meanwhile, leave {', '.join(unusable)} out: "
                f"snakemake --config only={','.join(others)}"
            )
        raise DflashEvalError(f"{source}: {len(problems)} problem(s), found before any job ran:\n" + "\n".join(shown))


def verify_problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for each evaluation.verify: rejection that a job would refuse (extraction or evaluation, after the
    server went down and outputs were removed): a DFlash2 drafter (its proposal is the candidate selector's walk,
    not independent per position, so the step programme does not hold), DDTree budgets with rejection alone (no
    rejection-sampled tree has a reference loop to hold it to; SGLang 0.5.23 verifies trees target-only), and
    min_p on a sampled dataset (dflash_generate has none). docs/sampling.md says why each is refused."""
    schemes = verify_schemes(config["evaluation"].get("verify"))
    if REJECTION not in schemes:
        return []
    problems = []
    budgets = sorted(set(config["evaluation"].get("ddtree_budgets") or []))
    if budgets and TARGET_ONLY not in schemes:
        methods = ", ".join(f"ddtree-{b}" for b in budgets)
        problems.append(
            (
                "evaluation.verify",
                f"rejection alone, but evaluation.ddtree_budgets asks for {methods}: "
                "DDTree has no rejection-sampled scheme here (dflash_generate drafts no tree; SGLang 0.5.23 "
                "verifies trees target-only). Set evaluation.verify: [target_only, rejection] (trees are "
                "then evaluated target_only, chains both ways) or evaluation.ddtree_budgets: []",
            )
        )
    for name, spec in config["drafters"].items():
        if _architecture(spec) == "DFlash2DraftModel":
            problems.append(
                (
                    f"drafters.{name}",
                    f"drafter {name} is a DFlash2DraftModel, but evaluation.verify asks for "
                    "rejection: its "
                    "drafts come from the candidate selector's walk over the block, not independently per "
                    "position, so dflash_generate's scheme does not apply to it; set evaluation.verify: "
                    "target_only (or remove this drafter from a rejection run)",
                )
            )
    for name, spec in config["datasets"].items():
        if dataset_samples(spec) and float(spec.get("min_p") or 0.0) > 0:
            problems.append(
                (
                    f"datasets.{name}.min_p",
                    f"{spec['min_p']}, but evaluation.verify asks for rejection, "
                    "dflash_generate's scheme, which has no min_p: set min_p: 0.0 or evaluation.verify: "
                    "target_only",
                )
            )
    return problems


def _architecture(spec: dict[str, Any]) -> str | None:
    """The drafter's class from its config.json's architectures, where it can be read now (else None)."""
    try:
        facts = checkpoint_facts(spec["path"], spec["layout"], spec.get("config"))
    except (DflashEvalError, OSError):
        return None
    found = facts.config.get("architectures") or []
    return "DFlash2DraftModel" if "DFlash2DraftModel" in found else (found[0] if found else None)


def _load_warnings(config: dict[str, Any], target_text: dict[str, Any] | None) -> list[str]:
    """Settings that run but do less than they say: named at every start (also in `snakemake -n`), not
    only in a job's log."""
    warnings = []
    if REJECTION in verify_schemes(config["evaluation"].get("verify")):
        greedy = [name for name, spec in config["datasets"].items() if not dataset_samples(spec)]
        if greedy:
            warnings.append(
                f"evaluation.verify asks for rejection, but datasets {', '.join(greedy)} are greedy "
                "(temperature 0), where dflash_generate's scheme is target_only's greedy verification "
                "(the drafts and the target are point masses): their tau is both schemes' number, and "
                "they get no rejection section (docs/sampling.md)"
            )
    requested = config["evaluation"]["block_sizes"]
    if isinstance(requested, list):
        for name, spec in config["drafters"].items():
            block = _block_size(spec)
            too_big = sorted(b for b in set(requested) if block is not None and b > block)
            if too_big:
                warnings.append(
                    f"evaluation.block_sizes {too_big} exceed drafters.{name}'s block size {block}: "
                    "its evaluation skips them (a chain's blocks cannot be longer than the drafter's)"
                )
    limit = (target_text or {}).get("max_position_embeddings")
    if isinstance(limit, int) and config["fetch"]["max_tokens"] >= limit:
        warnings.append(
            f"fetch.max_tokens {config['fetch']['max_tokens']} reaches the target's max_position_embeddings "
            f"{limit} ({config['target']['path']}/config.json): prompt and completion beyond {limit} "
            "positions are past what the target was built for; lower fetch.max_tokens"
        )
    return warnings


def _block_size(spec: dict[str, Any]) -> int | None:
    """The drafter's block size from its config.json, where it can be read now (else None: no warning)."""
    try:
        facts = checkpoint_facts(spec["path"], spec["layout"], spec.get("config"))
    except (DflashEvalError, OSError):
        return None
    block = facts.config.get("block_size")
    return int(block) if isinstance(block, int) else None


def _check_drafter(spec: dict[str, Any], target_text: dict[str, Any] | None) -> None:
    """The checkpoint's config and headers against config.yaml and the target (see evaluate.checkpoint)."""
    facts = checkpoint_facts(spec["path"], spec["layout"], spec.get("config"))
    ids = check_checkpoint(facts, spec.get("layer_ids"), target_text)
    if target_text and target_text.get("num_hidden_layers") is not None:
        check_layer_ids(ids, int(target_text["num_hidden_layers"]))


def warn_changed_caches(caches: Iterable[str]) -> None:
    """A warning at load (also in `snakemake -n`) for every cache shard modified after its extraction.

    A warning, not an error: metrics already computed read the shard before it changed (and verified
    it), evaluations to come refuse it if its bytes are damaged, and the repair command must still run.
    """
    for directory in caches:
        changed = changed_since_extraction(Path(directory))
        if changed:
            manifest = cache_manifest.read(Path(directory))
            sys.stderr.write(
                f"WARNING: {len(changed)} shard(s) of the hidden cache {directory} changed after its "
                f"extraction: {'; '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}. An evaluation "
                "refuses a shard whose sha256 no longer matches; "
                f"{repair_command(Path(directory), manifest)}\n"
            )
