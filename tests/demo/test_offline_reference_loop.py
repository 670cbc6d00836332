"""The central test at demo scale: served completions, cached states, the trained demo drafter.

For every demo prompt, the evaluator's acceptance length at each verification step (from the
workflow's own results) must equal what `dflash.model.dflash_generate` produces running the demo
target live (with exact cache rollback: see reference.exact_target_rollback; as published, the
loop keeps rejected draft tokens in the target's Gated DeltaNet states). Where a step differs, the difference must be a floating-point near-tie: the two
largest logits (target's or drafter's) within NEAR_TIE of each other at the position that
decided it; a served completion that differs from the reference loop's output is judged the same
way. Needs the demo built and run (`snakemake --cores 2`), so it is marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from dflash_eval.demo.reference import first_difference, run_reference_loop, top2_gap

REPO = Path(__file__).resolve().parents[2]
DRAFTER = "demo-step900-pt"
DATASET = "demo-code"
NEAR_TIE = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo():
    import yaml
    from transformers import AutoModelForCausalLM

    from dflash_eval.evaluate.drafter import load_drafter

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    samples = REPO / "results" / "eval" / DRAFTER / DATASET / "samples.csv"
    if not samples.exists():
        pytest.skip("run the demo first: snakemake --cores 2")
    target = AutoModelForCausalLM.from_pretrained(REPO / config["target"]["path"], dtype=torch.float32).eval()
    spec = config["drafters"][DRAFTER]
    drafter = load_drafter(REPO / spec["path"], config=REPO / spec["config"]).model
    records = [json.loads(line) for line in (REPO / "results" / "completions" / f"{DATASET}.jsonl").open()]
    rows = pd.read_csv(samples, dtype={"id": str, "acceptance_lengths": str})
    rows = rows[rows["method"] == f"chain-B{drafter.block_size}"].set_index("id")  # the drafter's own block
    return config, target, drafter, records, rows


def decision_gaps(target, drafter, ids: list[int], anchor: int, served: list[int]) -> list[float]:
    """Top-2 logit gaps of every decision that shaped the step at `anchor`: the target's greedy
    choices over the verified block, the drafter's proposals, and the first split between the served output and the reference loop's."""
    block = drafter.block_size
    end = min(anchor + block + 1, len(ids))
    with torch.no_grad():
        out = target(torch.tensor([ids[:end]]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1][0] for i in drafter.target_layer_ids], dim=-1)
        noise = torch.full((1, block), drafter.mask_token_id)
        noise[0, 0] = ids[anchor]
        hidden = drafter(
            target_hidden=features[None, :anchor],
            noise_embedding=target.get_input_embeddings()(noise),
            position_ids=torch.arange(anchor + block)[None],
        )[:, 1:]
        draft_logits = drafter.compute_logits(hidden, target.lm_head)[0]
    gaps = [top2_gap(out.logits[0, p]) for p in range(anchor - 1, end)]
    gaps += [top2_gap(row) for row in draft_logits]
    split = first_difference(served, ids)
    if split is not None and split < end:
        gaps.append(top2_gap(out.logits[0, split - 1]))
    return gaps


def test_every_demo_prompt_matches_the_reference_loop(demo):
    config, target, drafter, records, rows = demo
    eos = json.loads((REPO / config["target"]["path"] / "generation_config.json").read_text())["eos_token_id"]
    stops = [eos] if isinstance(eos, int) else list(eos)
    exact, explained, failures = 0, 0, []
    for record in records:
        prompt = record["prompt_token_ids"]
        served = prompt + record["completion_token_ids"]
        ref_steps, ref_ids = run_reference_loop(drafter, target, prompt, record["request"]["max_tokens"], stops)
        offline_text = rows.loc[str(record["id"])]["acceptance_lengths"]
        offline = [int(x) for x in str(offline_text).split()] if isinstance(offline_text, str) else []
        step = first_difference(offline, ref_steps)
        if step is None:
            exact += 1
            continue
        position = len(prompt) + sum(ref_steps[:step])  # the anchor of the first differing step
        gaps = decision_gaps(target, drafter, ref_ids, position, served)
        if min(gaps) < NEAR_TIE:
            explained += 1
        else:
            failures.append((record["id"], step, offline[step : step + 3], ref_steps[step : step + 3], min(gaps)))
    print(f"exact {exact}, near-tie {explained}, unexplained {len(failures)} of {len(records)}")
    assert not failures, failures
    assert exact >= 0.9 * len(records)
