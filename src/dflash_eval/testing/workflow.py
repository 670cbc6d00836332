"""Run a copy of the real Snakefile on a tiny project and read back which jobs it plans or ran.

Which jobs Snakemake schedules depends on the rules, their params and inputs, not on what a stage computes. So
the copy's `dflash-eval` is a recorder that writes each rule's declared outputs (stamped with its settings) and
logs the call: a full run takes seconds and needs no server or model. The workflow is copied from a directory the
caller names (a checkout: Snakefile, workflow/, profiles/, src/); nothing here assumes where this file lies.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

RECORDER = r'''#!{python}
"""Stand-in for dflash-eval in workflow tests: writes the declared outputs and logs the call."""
import importlib.util, json, os, sys
from pathlib import Path

args = sys.argv[1:]
if args[:1] == ["--log"]:
    args = args[2:]
command, rest = args[0], args[1:]
opts = {{rest[i]: rest[i + 1] for i in range(len(rest) - 1) if rest[i].startswith("--")}}
stamp = json.dumps({{"command": command, "settings": opts.get("--settings"),  # and the code the rule planned with
                    "code_identity": os.environ.get("DFLASH_EVAL_CODE")}}, sort_keys=True)
outputs = {{"fetch": ["--out"], "extract": ["--out"], "evaluate": ["--metrics", "--samples"],
           "export": ["--profile", "--record"], "report": ["--csv", "--md", "--trust"]}}.get(command, [])
if outputs:
    with open("calls.log", "a") as log:
        log.write(f"{{command}} {{opts[outputs[0]]}}\n")
    if "--runtime" in opts:
        with open("runtime.log", "a") as log:
            log.write(opts["--runtime"] + "\n")
    with open("packages.log", "a") as log:  # the dflash_eval a real call would import here (PYTHONPATH)
        log.write(importlib.util.find_spec("dflash_eval").origin + "\n")
for key in outputs:
    path = Path(opts[key])
    if command == "extract":
        path.mkdir(parents=True, exist_ok=True)
        (path / "manifest.json").write_text(stamp)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stamp)
if command == "fetch":  # its stamp beside the completions, as provenance.stamps.write_side_stamp writes it
    engine = json.loads(opts.get("--runtime") or "{{}}").get("server", {{}}).get("engine") or "auto"
    Path(opts["--out"] + ".stamp.json").write_text(
        json.dumps({{"code_identity": os.environ.get("DFLASH_EVAL_CODE"), "engine": engine}}))
if command == "report":  # every registered plot, as the stage writes them
    from dflash_eval.report.plots import PLOTS
    for plot in PLOTS.values():
        Path(opts["--plot-dir"]).mkdir(parents=True, exist_ok=True)
        (Path(opts["--plot-dir"]) / plot.file).write_text(stamp)
'''


WORKFLOW_PARTS = ("Snakefile", "workflow", "profiles", "src")


def copy_workflow(dest: Path, source: Path) -> Path:
    """A private copy of `source`'s workflow and package in `dest`, so a test may edit stage code."""
    missing = [part for part in WORKFLOW_PARTS if not (source / part).exists()]
    if missing:
        raise FileNotFoundError(f"{source} is not a dflash-eval checkout: it has no {', '.join(missing)}")
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        path = source / part
        if path.is_dir():
            shutil.copytree(path, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, dest / part)
    recorder = dest / "bin" / "dflash-eval"
    recorder.parent.mkdir(parents=True)
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    return dest


def copy_workflow_with_stand_in(dest: Path, source: Path, stand_in: str) -> Path:
    """`copy_workflow` whose `dflash-eval` is `stand_in` (a script template with {python}), the recorder kept
    beside it as `bin/recorder` for the stand-in to hand over to."""
    workflow = copy_workflow(dest, source)
    (workflow / "bin" / "dflash-eval").rename(workflow / "bin" / "recorder")
    script = workflow / "bin" / "dflash-eval"
    script.write_text(stand_in.format(python=sys.executable))
    script.chmod(0o755)
    return workflow


def write_bytes(path: Path, size: int, seed: int) -> None:
    """Deterministic pseudo-random bytes: the same seed gives the same content. A `.safetensors` file
    gets a real header around them (one uint8 tensor), as the workflow reads every header when it loads."""
    import random

    path.parent.mkdir(parents=True, exist_ok=True)
    data = random.Random(seed).randbytes(size)
    if path.suffix == ".safetensors":
        header = json.dumps({"blob": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
        data = len(header).to_bytes(8, "little") + header + data
    path.write_bytes(data)


def tiny_project(root: Path, drafters: int = 2, datasets: int = 2, big_checkpoint: bool = True) -> dict:
    """Target, drafters and prompts as small files, and a config.yaml that names them relatively."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text('{"num_hidden_layers": 4}')
    write_bytes(root / "target" / "model.safetensors", 4096, seed=1)
    config = {
        "target": {"path": "target", "device": "cpu", "dtype": "float32", "backend": "torch"},
        "server": {"kind": "managed", "base_url": "http://127.0.0.1:9", "command": "true"},
        "fetch": {"max_tokens": 8},
        "datasets": {},
        "extraction": {},
        "evaluation": {"bootstrap": 10},
        "drafters": {},
    }
    for i in range(datasets):
        prompts = root / "prompts" / f"d{i + 1}.jsonl"
        prompts.parent.mkdir(exist_ok=True)
        prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n")
        config["datasets"][f"d{i + 1}"] = {"prompts": str(prompts.relative_to(root))}
    for i in range(drafters):
        name = "ab"[i] if i < 2 else f"x{i}"
        if i == 1 and big_checkpoint:  # a .pt training checkpoint, 50 MB: content-hashed, never mtime-compared
            write_bytes(root / "ckpt" / "b.pt", 50 * 2**20, seed=20)
            (root / "ckpt" / "b.json").write_text('{"block_size": 4}')
            config["drafters"][name] = {
                "path": "ckpt/b.pt",
                "config": "ckpt/b.json",
                "layer_ids": [1, 2],
                "trained_with": "torch",
            }
        else:
            add_hf_drafter(root, config, name, seed=10 + i)
    save_config(root, config)
    return config


def add_hf_drafter(root: Path, config: dict, name: str, seed: int, layer_ids: list[int] | None = None) -> None:
    (root / "ckpt" / name).mkdir(parents=True)
    (root / "ckpt" / name / "config.json").write_text('{"block_size": 4}')
    write_bytes(root / "ckpt" / name / "model.safetensors", 2048, seed=seed)
    config["drafters"][name] = {"path": f"ckpt/{name}", "layer_ids": layer_ids or [1, 2], "trained_with": "torch"}


def save_config(root: Path, config: dict) -> None:
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def load_config(root: Path) -> dict:
    return yaml.safe_load((root / "config.yaml").read_text())


def snakemake(
    workflow: Path,
    root: Path,
    *args: str,
    profile: str = "default",
    timeout: int = 600,
    env: dict | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """The real snakemake on `workflow`'s copy, in `root`, with that copy's package on PYTHONPATH.

    By default the run is a child forked from a process that imported Snakemake once (see
    `_forked_snakemake`); `fresh=True` starts a new interpreter, as a user's command line does
    (for timings that must include Snakemake's own start-up).
    """
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(workflow / "src"),
        "PATH": f"{workflow / 'bin'}{os.pathsep}{os.environ['PATH']}",
        **(env or {}),
    }
    argv = [
        "--snakefile",
        str(workflow / "Snakefile"),
        "--directory",
        str(root),
        "--configfile",
        str(root / "config.yaml"),
        "--workflow-profile",
        str(workflow / "profiles" / profile),
        "--cores",
        "2",
        *args,
    ]
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "snakemake", *argv],
            cwd=root,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return _forked_snakemake(argv, root, environment, timeout)


# Importing Snakemake and its plugins (the SLURM plugin pulls in pandas and SQLAlchemy) is most of
# the CPU time of a dry run of a tiny project. A multiprocessing fork server imports it once; each
# run is a child forked from it, which then runs Snakemake's own command-line entry point. The
# server imports dflash_eval only to reach this module; each child drops it and imports the package copy on its
# PYTHONPATH (tests that edit a copy's code see their edit).
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["snakemake.cli"])


def _forked_snakemake(argv: list[str], cwd: Path, environment: dict, timeout: int) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = _FORKS.Process(target=_snakemake_main, args=(argv, str(cwd), environment, str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["snakemake", *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["snakemake", *argv], child.exitcode, out.read_text(), err.read_text())


def _snakemake_main(argv: list[str], cwd: str, environment: dict, out: str, err: str) -> None:
    """In the forked child: this run's directory, environment, sys.path and output files, then Snakemake."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    sys.path[:0] = environment["PYTHONPATH"].split(os.pathsep)
    # Unpickling this function imported dflash_eval from where the caller's copy lies; the run must import the
    # copy on its PYTHONPATH instead (a test that edits the copy's code sees its edit).
    for name in [name for name in sys.modules if name == "dflash_eval" or name.startswith("dflash_eval.")]:
        del sys.modules[name]
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as handle:
            os.dup2(handle.fileno(), fd)
    sys.argv = ["snakemake", *argv]
    from snakemake.cli import main

    main(argv)  # exits through SystemExit, whose code multiprocessing turns into the exit code


def check(run: subprocess.CompletedProcess) -> str:
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    return text


_JOB = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):\s*$")


def planned_jobs(text: str) -> set[str]:
    """Jobs of a dry-run plan as 'rule first-output', the target rule `all` left out."""
    jobs, rule = set(), None
    for line in text.splitlines():
        match = _JOB.match(line)
        if match:
            rule = match.group(1)
        elif rule and line.strip().startswith("output:"):
            if rule != "all":
                first = line.split("output:", 1)[1].split(",")[0].strip()
                jobs.add(f"{rule} {first.removesuffix(' (update)')}")  # the report's outputs are update()
            rule = None
    return jobs


def plan(workflow: Path, root: Path, *args: str) -> set[str]:
    return planned_jobs(check(snakemake(workflow, root, "--dry-run", *args)))


def job(rule: str, *parts: str) -> str:
    """Readable expected job: job('evaluate', 'a', 'd1') -> 'evaluate results/eval/a/d1/metrics.json'."""
    paths = {
        "fetch": lambda dataset: f"results/completions/{dataset}.jsonl",
        "extract": lambda dataset, layers: f"results/hidden/{dataset}/{layers}",
        "evaluate": lambda drafter, dataset: f"results/eval/{drafter}/{dataset}/metrics.json",
        "export": lambda drafter, dataset: f"results/eval/{drafter}/{dataset}/speculation_profile.json",
        "report": lambda: "results/summary.csv",
    }
    return f"{rule} {paths[rule](*parts)}"


def fold_exports(jobs: set[str]) -> set[str]:
    """`jobs` without the export job of each evaluation that is among them: an export follows exactly its
    evaluation, so the rerun tests state the evaluations (an export planned alone stays)."""
    evaluated = {j.removesuffix("/metrics.json") for j in jobs if j.startswith("evaluate ")}
    return {
        j
        for j in jobs
        if not (
            j.startswith("export ")
            and "evaluate " + j.removeprefix("export ").removesuffix("/speculation_profile.json") in evaluated
        )
    }
