"""The real `snakemake` end to end against the demo server in vLLM 0.34.0 mode (`demo-server --engine vllm`):
exact ids in and out, the per-request detailed spec metrics in every record, and the online panel equal on every
request, greedy (T = 0) and sampled (T 0.7: greedy drafts, standard rejection, so a draft is accepted iff it is
the emitted token). The served drafter is evaluated offline in fp32 on the CPU, as the server runs it."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from dflash_eval.testing.fixtures import free_port
from tests.support.checkout import REPO, snakemake_in
from tests.support.tiny import build_demo_target, tiny_drafter_config

pytestmark = pytest.mark.slow
BLOCK = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import torch
    from dflash import DFlashDraftModel

    root = tmp_path_factory.mktemp("vllm-workflow")
    target_dir = build_demo_target(root / "target", steps=0)
    target_config = json.loads((target_dir / "config.json").read_text())
    tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|mask|>")
    config = tiny_drafter_config(
        [1, 2],
        hidden=target_config["hidden_size"],
        block_size=BLOCK,
        window=8,
        num_target_layers=target_config["num_hidden_layers"],
    )
    config.vocab_size = target_config["vocab_size"]
    config.dflash_config["mask_token_id"] = mask_id
    torch.manual_seed(0)
    DFlashDraftModel(config).save_pretrained(root / "drafters" / "hf")
    prompts = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"Write a function number {i}."}]} for i in range(4)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    port = free_port()
    spec = json.dumps({"method": "dflash", "model": str(root / "drafters" / "hf"), "num_speculative_tokens": BLOCK - 1})
    settings = yaml.safe_load((REPO / "config.yaml").read_text())
    settings.pop("demo")
    settings["target"]["path"] = str(target_dir)
    settings["server"].update(
        base_url=f"http://127.0.0.1:{port}",
        health_timeout_s=600,
        engine="vllm",
        command=f"env OMP_NUM_THREADS=1 VLLM_SERVER_DEV_MODE=1 {sys.executable} -m dflash_eval.cli demo-server "
        f"--engine vllm --port {port} --model-path {target_dir} --speculative-config '{spec}' "
        "--per-request-spec-decode-metrics detailed --enable-sleep-mode",
    )
    settings["fetch"].update(max_tokens=24, concurrency=2)
    settings["datasets"] = {
        "tiny": {"prompts": str(root / "prompts.jsonl")},
        "tiny-t07": {
            "prompts": str(root / "prompts.jsonl"),
            "temperature": 0.7,
            "top_p": 0.95,
            "n": 2,
            "sampling_seed": 0,
        },
    }
    settings["evaluation"]["bootstrap"] = 50
    settings["report"]["served_drafter"] = "hf"
    settings["profile_server"]["enabled"] = False
    settings["drafters"] = {"hf": {"path": str(root / "drafters" / "hf"), "trained_with": "torch"}}
    (root / "config.yaml").write_text(yaml.safe_dump(settings))
    return root


def test_the_online_panel_is_equal_per_request_at_t0_and_t07(workdir):
    run = snakemake_in(workdir)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for dataset, count in (("tiny", 4), ("tiny-t07", 8)):
        records = [
            json.loads(line)
            for line in (workdir / "results" / "completions" / f"{dataset}.jsonl").read_text().splitlines()
        ]
        assert len(records) == count
        for record in records:
            assert record["completion_ids_source"] == "server" and record["request"]["prompt_format"] == "token_ids"
            assert record["spec"]["engine"] == "vllm" and record["spec"]["per_step_accepted"] is not None
            assert record["server"]["speculative"]["per_request_spec_decode_metrics"] == "detailed"
    online = json.loads((workdir / "results" / "trust.json").read_text())["online"]
    for dataset, count in (("tiny", 4), ("tiny-t07", 8)):
        panel = online[dataset]
        assert panel["compared"], panel
        assert panel["served_drafter_check"]["status"] == "verified", panel["served_drafter_check"]
        assert panel["verification_rule"] == [["greedy", "standard"]]
        assert panel["samples_compared"] == count and panel["equal_requests"] == count, panel["unequal_ids"]
        assert panel["tau_vllm_definition"]
        for row in panel["per_request"].values():
            assert row["online_steps_list"] is not None
            assert row["online_mean_acceptance_length"] >= row["offline_mean_acceptance_length"]
    summary = (workdir / "results" / "summary.md").read_text()
    assert "| tiny | hf |" in summary and "4 of 4" in summary
