"""Every stage's by-hand command, run as its docs give it (README, docs/*.md, `--help`), on a tiny real project: a
real speculating server (the demo server of a tiny Qwen3.5 target and a DFlash drafter), real processes, the
real console entry. The commands run in the order a user runs them, each on the outputs of the one before:

  server up/status/down/up/stop-launched/finish   docs/server.md ("By hand"), README
  fetch --config --dataset --out                   docs/contracts.md (by hand: --config plus the selector)
  extract ... --layers 0,1                         issue 45's crash: `--help` says "comma-separated layer ids"
  evaluate --config --drafter --dataset ...        docs/running.md
  report --config --metrics ... --csv --md         `dflash-eval report --help`
  profile-server --config --completions --out      docs/speedup.md
  compare-backends --target --completions --layers docs/running.md (fla needs CUDA: on a CPU, a clear refusal)
  gpu-placements results/benchmarks/evaluate       docs/cluster.md
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dflash_eval.testing import fixtures
from tests.support import servers as hs
from tests.support.demo_server import demo_server_command, tiny_drafter_dir

pytestmark = pytest.mark.slow  # a dozen commands, two demo-server launches and the profile's four


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("by-hand")
    target = hs.build_tiny_target(root / "target")
    tiny_drafter_dir(target, root / "drafter", layer_ids=[0, 1], scale=None)  # layer 1: the final norm's output
    fixtures.write_prompts(root / "prompts.jsonl", 3)
    port = fixtures.free_port()
    config = {
        "demo": {"enabled": False},
        "target": {"path": "target", "dtype": "float32", "device": "cpu", "backend": "torch"},
        "server": {
            "kind": "managed",
            "base_url": f"http://127.0.0.1:{port}",
            "health_timeout_s": 120,
            "stop_grace_s": 5,
            "command": demo_server_command("target", "drafter", port, extra="--enable-metrics"),
        },
        "fetch": {"max_tokens": 12, "concurrency": 2},
        "datasets": {"tiny": {"prompts": "prompts.jsonl"}},
        "extraction": {},
        "evaluation": {"bootstrap": 20, "ddtree_budgets": [4]},
        "profile_server": {"acceptance_lengths": [2], "requests": 2, "max_new_tokens": 5},
        "drafters": {"d": {"path": "drafter", "trained_with": "torch"}},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    yield root
    by_hand(root, "dflash-eval server finish --config config.yaml")  # whatever a failed test left running


def by_hand(root: Path, line: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`line` as the docs write it, `dflash-eval` being this checkout's console entry, run in the project."""
    words = shlex.split(line)
    assert words[0] == "dflash-eval"
    done = subprocess.run(
        [sys.executable, "-m", "dflash_eval.cli", *words[1:]],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if ok:
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def _status(root: Path) -> dict:
    return json.loads(by_hand(root, "dflash-eval server status --config config.yaml", ok=False).stdout)


def test_1_server_by_hand(project):
    by_hand(project, "dflash-eval server up --config config.yaml")
    status = _status(project)
    assert status["healthy"] and status["launch"]["variant"] is None
    pid = status["launched_pid"]
    by_hand(project, "dflash-eval server down --config config.yaml")
    assert not _status(project)["healthy"] and _status(project)["outage"] is not None
    by_hand(project, "dflash-eval server up --config config.yaml")
    back = _status(project)
    assert back["healthy"] and back["outage"] is None and back["launched_pid"] != pid
    by_hand(project, "dflash-eval server stop-launched --config config.yaml")
    assert by_hand(project, "dflash-eval server status --config config.yaml", ok=False).returncode == 3
    by_hand(project, "dflash-eval server finish --config config.yaml")  # idempotent: nothing left to do


def test_2_fetch_by_hand(project):
    by_hand(project, "dflash-eval fetch --config config.yaml --dataset tiny --out results/completions/tiny.jsonl")
    records = [json.loads(line) for line in (project / "results/completions/tiny.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["completion_ids_source"] == "server" for r in records)


def test_3_extract_by_hand_with_comma_separated_layers(project):
    """The issue's crash: `--layers 1,5` (here the tiny target's 0,1) ended in AttributeError in parse_layerset.
    The server the fetch launched is up: the extraction pauses it and brings it back."""
    assert _status(project)["healthy"]
    by_hand(
        project,
        "dflash-eval extract --config config.yaml --dataset tiny --layers 0,1 "
        "--completions results/completions/tiny.jsonl --out results/hidden/tiny/L0-1",
    )
    manifest = json.loads((project / "results/hidden/tiny/L0-1/manifest.json").read_text())
    assert manifest["layer_ids"] == [0, 1] and manifest["samples"]
    assert _status(project)["healthy"]  # restored after the extraction
    # the variation: the cache directory's layer-set name, as the workflow names it
    by_hand(
        project,
        "dflash-eval extract --config config.yaml --dataset tiny --layers L0-1 "
        "--completions results/completions/tiny.jsonl --out results/hidden/tiny/by-name",
    )
    again = json.loads((project / "results/hidden/tiny/by-name/manifest.json").read_text())
    assert again["layer_ids"] == [0, 1] and [s["sha256"] for s in again["shards"]] == [
        s["sha256"] for s in manifest["shards"]
    ]
    bad = by_hand(
        project,
        "dflash-eval extract --config config.yaml --dataset tiny --layers 0,x "
        "--completions results/completions/tiny.jsonl --out results/hidden/tiny/bad",
        ok=False,
    )
    assert bad.returncode == 2 and "--layers '0,x': expected comma-separated integers" in bad.stderr, bad.stderr


def test_4_evaluate_by_hand(project):
    by_hand(
        project,
        "dflash-eval evaluate --config config.yaml --drafter d --dataset tiny "
        "--hidden results/hidden/tiny/L0-1 --completions results/completions/tiny.jsonl "
        "--metrics results/eval/d/tiny/metrics.json --samples results/eval/d/tiny/samples.csv "
        "--placement results/benchmarks/evaluate/d/tiny.gpu.json",
    )
    metrics = json.loads((project / "results/eval/d/tiny/metrics.json").read_text())
    assert metrics["chain"]["samples"] == 3 and metrics["chain"]["tau_token_weighted"] >= 1.0


def test_5_report_by_hand(project):
    by_hand(
        project,
        "dflash-eval report --config config.yaml --metrics results/eval/d/tiny/metrics.json "
        "--hidden results/hidden/tiny/L0-1 --completions results/completions/tiny.jsonl "
        "--csv results/summary.csv --md results/summary.md --trust results/trust.json "
        "--plot-dir results/plots",
    )
    assert "d" in (project / "results/summary.csv").read_text() and (project / "results/summary.md").is_file()


def test_6_profile_server_by_hand(project):
    """docs/speedup.md's command; the configured server, up before, is up after it, and no variant is left."""
    by_hand(project, "dflash-eval server up --config config.yaml")
    by_hand(
        project,
        "dflash-eval profile-server --config config.yaml --completions results/completions/tiny.jsonl "
        "--out results/server_profile.json",
    )
    profile = json.loads((project / "results/server_profile.json").read_text())
    assert [s["name"] for s in profile["settings"]] == ["no-speculation", "acc-len-2", "served"]
    status = _status(project)
    assert status["healthy"] and status["launch"]["variant"] is None
    by_hand(project, "dflash-eval server finish --config config.yaml")
    assert not _status(project)["healthy"]


def test_7_compare_backends_by_hand(project):
    """docs/running.md's command (fla against torch, on cuda:0 by default). Without CUDA it must end in one line
    that says why, before the target loads; on a GPU machine it runs (`python -m pytest -m slow` there)."""
    line = (
        "dflash-eval compare-backends --target target --completions results/completions/tiny.jsonl "
        "--layers 0,1 --drafter drafter --out results/backends.json"
    )
    if torch.cuda.is_available():
        by_hand(project, line)
        assert json.loads((project / "results/backends.json").read_text())
        return
    done = by_hand(project, line, ok=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "CUDA" in done.stderr and "Qwen3_5ForCausalLM" not in done.stderr, done.stderr[-3000:]


def test_8_gpu_placements_by_hand(project):
    done = by_hand(project, "dflash-eval gpu-placements results/benchmarks/evaluate --expect-peak 0")
    assert "CPU jobs: 1" in done.stdout, done.stdout
