"""The real `snakemake` on a tiny config, end to end, with a real `transformers serve` process."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
import yaml

from dflash_eval.testing.fixtures import free_port
from tests.support.checkout import REPO, snakemake_in
from tests.support.servers import (
    TORCH_SERVE,
    check_down_around_extraction,
    group_members,
)
from tests.support.tiny import build_demo_target, tiny_drafter_config

# Passed in 109 s on two pinned cores of an otherwise idle machine (2026-11-30); slow for CI's
# budget. Run it with `python -m pytest -m slow tests/workflow/test_demo_workflow.py`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import torch
    from dflash import DFlashDraftModel

    root = tmp_path_factory.mktemp("workflow")
    target_dir = build_demo_target(root / "target", steps=0)
    target_config = json.loads((target_dir / "config.json").read_text())
    tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|mask|>")
    config = tiny_drafter_config(
        [1, 2],
        hidden=target_config["hidden_size"],
        block_size=4,
        window=8,
        num_target_layers=target_config["num_hidden_layers"],
    )
    config.vocab_size = target_config["vocab_size"]
    config.dflash_config["mask_token_id"] = mask_id
    torch.manual_seed(0)
    drafter = DFlashDraftModel(config)
    drafter.save_pretrained(root / "drafters" / "hf")
    torch.save({"model_state_dict": drafter.state_dict(), "global_step": 7, "epoch": 0.5}, root / "drafters" / "d.pt")
    prompts = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"Write a function number {i}."}]} for i in range(3)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    port = free_port()
    settings = yaml.safe_load((REPO / "config.yaml").read_text())
    settings.pop("demo")
    settings["target"]["path"] = str(target_dir)
    settings["server"].update(
        base_url=f"http://127.0.0.1:{port}",
        health_timeout_s=600,
        command=f"{sys.executable} {TORCH_SERVE} serve --port {port} --device cpu --dtype float32 {target_dir}",
    )
    settings["fetch"].update(max_tokens=12, concurrency=2)
    settings["datasets"] = {"tiny": {"prompts": str(root / "prompts.jsonl")}}
    settings["evaluation"]["bootstrap"] = 50
    settings["report"]["served_drafter"] = None  # transformers serve does not speculate (a third-party server)
    settings["profile_server"]["enabled"] = False  # it needs a speculating server; test_profile_rule.py runs it
    settings["drafters"] = {
        "hf": {"path": str(root / "drafters" / "hf"), "trained_with": "torch"},
        "pt": {
            "path": str(root / "drafters" / "d.pt"),
            "config": str(root / "drafters" / "hf" / "config.json"),
            "layer_ids": [1, 2],
            "trained_with": "torch",
        },
    }
    (root / "config.yaml").write_text(yaml.safe_dump(settings))
    return root


def test_pipeline_end_to_end(workdir):
    run = snakemake_in(workdir)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = pd.read_csv(workdir / "results" / "summary.csv")
    assert set(summary["drafter"]) == {"hf", "pt"}
    for name in ("hf", "pt"):
        metrics = json.loads((workdir / "results" / "eval" / name / "tiny" / "metrics.json").read_text())
        row = summary[summary["drafter"] == name].iloc[0]
        assert row["tau_mean_of_samples"] == pytest.approx(metrics["chain"]["tau_mean_of_samples"])
        assert metrics["chain"]["samples"] == 3 and metrics["chain"]["tau_token_weighted"] >= 1.0
    hf, pt = (
        json.loads((workdir / "results" / "eval" / n / "tiny" / "metrics.json").read_text()) for n in ("hf", "pt")
    )
    assert hf["chain"] == pt["chain"], "the same weights in two layouts must give the same numbers"
    assert pt["checkpoint"]["global_step"] == 7
    assert "hf" in (workdir / "results" / "summary.md").read_text()
    manifest = json.loads((workdir / "results" / "hidden" / "tiny" / "L1-2" / "manifest.json").read_text())
    assert manifest["backend"]["name"] == "torch" and manifest["layer_ids"] == [1, 2]
    records = [json.loads(l) for l in (workdir / "results" / "completions" / "tiny.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["prompt_token_ids"] for r in records)
    # the server went down before the extraction and was healthy after it; the run's end stopped it
    entries = check_down_around_extraction(workdir / "results" / "logs" / "server" / "transitions.jsonl")
    assert [e["event"] for e in entries][-2:] == ["stop_requested", "down"]
    assert all(group_members(e["pid"]) == [] for e in entries if e["event"] == "launched")
    # a second run has nothing to do
    again = snakemake_in(workdir, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-2000:]
