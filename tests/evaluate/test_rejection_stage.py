"""The evaluate stage with `verify: [target_only, rejection]` on a real tiny target, drafter and cache (the CLI):
its per-sample expected tau equals the step chain run on an independent reference (the target's Hugging Face
forward and the reference drafter's block recomputed from scratch at every anchor, both renormalised by dflash's
own `_sampling_probs`), for the drafter's own block and a shorter chain (dflash_generate with block_size 3, its
blocks drafted as 3-token blocks); target_only's outputs are the same bytes as without the rejection scheme; the
two draws of each prompt are one cluster of every bootstrap; a cache without target log-probs is refused naming
the fix."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dflash_eval import cli, stats
from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.rejection import step_distribution
from dflash_eval.extract import stage as extract_stage
from tests.support.extract_runs import evaluate_settings
from tests.support.reference import _draft_logprobs
from tests.support.tiny import tiny_drafter, tiny_target

LAYERS, BLOCK, SHORT, MAX_TOKENS = [0, 2], 4, 3, 9
SAMPLING = {"temperature": 1.5, "top_p": 0.95, "top_k": 120, "min_p": 0.0, "seed": 0}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("rejection-stage")
    target = tiny_target()
    target.save_pretrained(root / "target")
    tiny_drafter(LAYERS, block_size=BLOCK).save_pretrained(root / "drafter", safe_serialization=True)
    rng = random.Random(0)
    records = []
    with torch.no_grad():
        for index in range(4):  # completions sampled from the target itself, so p_T > 0 on them: 2 prompts x 2
            if index % 2 == 0:
                ids = [rng.randrange(2, 290) for _ in range(3)]
            torch.manual_seed(index)
            out = target.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=True,
                temperature=1.5,
                top_p=0.95,
                top_k=120,
                eos_token_id=1,
                pad_token_id=1,
            )[0].tolist()
            records.append(
                {
                    "id": f"p{index // 2}#s{index % 2}",
                    "prompt_token_ids": ids,
                    "completion_token_ids": out[3:],
                    "request": {"max_tokens": MAX_TOKENS},
                    "completion_ids_source": "server",
                    "token_check": {},
                    "sampling": SAMPLING,
                }
            )
    completions = root / "c.jsonl"
    completions.write_text("".join(json.dumps(r) + "\n" for r in records))
    extract = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "shard_tokens": 24,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
        "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
    }
    extract_stage.extract({**extract, "target_logprobs": True}, completions, root / "hidden")
    extract_stage.extract(extract, completions, root / "hidden-plain")
    evaluate = evaluate_settings(
        root,
        max_tokens=MAX_TOKENS,
        ddtree_budgets=[4],
        topk=[1],
        block_sizes=[SHORT],
    )
    return root, records, evaluate


def _evaluate(root, settings, out, hidden="hidden"):
    out.mkdir(exist_ok=True)
    code = cli.main(
        [
            "--log",
            str(out / "log"),
            "evaluate",
            "--settings",
            json.dumps(settings),
            "--hidden",
            str(root / hidden),
            "--completions",
            str(root / "c.jsonl"),
            "--metrics",
            str(out / "metrics.json"),
            "--samples",
            str(out / "samples.csv"),
        ]
    )
    return code, (out / "log").read_text()


def _reference_expected_tau(root, record, block: int) -> float:
    from dflash.model import DFlashDraftModel, _sampling_probs

    target = tiny_target()
    drafter = DFlashDraftModel.from_pretrained(root / "drafter").eval()
    ids = record["prompt_token_ids"] + record["completion_token_ids"]
    prompt_len = len(record["prompt_token_ids"])
    args = (SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["top_k"])
    with torch.no_grad():
        p = _sampling_probs(target(torch.tensor([ids])).logits[0], *args)
    limits = sequence_limits(prompt_len, len(ids), MAX_TOKENS, ids[-1] == 1)
    alpha = np.ones((len(ids) - 1 - prompt_len, block - 1))
    for i in range(alpha.shape[0]):
        anchor = prompt_len + i
        size = min(block, limits.max_length - anchor)
        if size <= 1:
            continue
        q = _sampling_probs(_draft_logprobs(drafter, target, ids, anchor, size), *args)
        for j in range(1, size):
            if anchor + j < len(ids):
                x = ids[anchor + j]  # a token the target's filter excludes: the draft there is rejected
                target_p = float(p[anchor + j - 1, x])
                alpha[i, j - 1] = min(1.0, float(q[j - 1, x]) / target_p) if target_p > 0 else 0.0
    return step_distribution(alpha, limits, [t == 1 for t in ids], block).expected_tau


def test_rejection_section_equals_the_independent_reference(project, tmp_path):
    root, records, settings = project
    code, log = _evaluate(root, {**settings, "verify": ["target_only", "rejection"]}, tmp_path / "both")
    assert code == 0, log
    metrics = json.loads((tmp_path / "both" / "metrics.json").read_text())
    assert metrics["verify"] == ["target_only", "rejection"] and metrics["sampling"] == [
        {k: v for k, v in SAMPLING.items() if k != "seed"}
    ]
    assert sorted(metrics["rejection"]["methods"]) == [f"chain-B{SHORT}", f"chain-B{BLOCK}"]
    for block in (BLOCK, SHORT):
        chain = metrics["rejection"]["methods"][f"chain-B{block}"]
        assert chain["scheme"] == "rejection" and chain["samples"] == 4 and chain["block_size"] == block
        for row, record in zip(chain["per_sample"], records):
            assert row["id"] == record["id"]
            assert row["expected_tau"] == pytest.approx(_reference_expected_tau(root, record, block), rel=1e-5)
        means = [r["expected_tau"] for r in chain["per_sample"]]
        assert chain["tau_mean_of_samples"] == pytest.approx(np.mean(means))
        assert 1.0 < chain["tau_mean_of_samples"] < block
        prompts = [r["id"].split("#")[0] for r in chain["per_sample"]]  # the CI resamples the 2 prompts
        assert chain["ci95"] == stats.bootstrap_per_sample(
            np.array(means),
            np.array([r["tokens"] for r in chain["per_sample"]], dtype=float),
            np.array([r["expected_steps"] for r in chain["per_sample"]]),
            10,
            0,
            clusters=prompts,
        )
        assert chain["ci95"] != stats.bootstrap_per_sample(  # not the per-draw bootstrap
            np.array(means),
            np.array([r["tokens"] for r in chain["per_sample"]], dtype=float),
            np.array([r["expected_steps"] for r in chain["per_sample"]]),
            10,
            0,
        )
    served = metrics["methods"][f"chain-B{BLOCK}"]
    steps = {}
    for line in (tmp_path / "both" / "samples.csv").read_text().splitlines()[1:]:
        fields = line.split(",")
        if fields[1] == f"chain-B{BLOCK}":
            steps[fields[0]] = [int(x) for x in fields[-1].split()]
    ids = sorted(steps)
    assert served["ci95"] == stats.bootstrap_ci([steps[i] for i in ids], 10, 0, clusters=[i[:2] for i in ids])
    code, log = _evaluate(root, settings, tmp_path / "plain")  # the default: target_only alone
    assert code == 0, log
    plain = json.loads((tmp_path / "plain" / "metrics.json").read_text())
    assert "rejection" not in plain and plain["verify"] == ["target_only"]
    assert (tmp_path / "plain" / "samples.csv").read_bytes() == (tmp_path / "both" / "samples.csv").read_bytes()
    assert plain["methods"] == metrics["methods"]


def test_a_cache_without_target_logprobs_is_refused(project, tmp_path):
    root, _, settings = project
    code, log = _evaluate(root, {**settings, "verify": "rejection"}, tmp_path / "x", hidden="hidden-plain")
    assert code != 0 and "holds no target log-probs" in log and "evaluation.verify including rejection" in log


def _forced(target, prompt: list[int], head: int, seed: int) -> list[int]:
    """A completion sampled from the target whose token `head` (0: the first) is the least likely one there, outside
    dflash's top-k support; the rest is sampled after it (inside the support)."""
    torch.manual_seed(seed)
    kwargs = {"do_sample": True, "temperature": 1.5, "top_p": 0.95, "top_k": 120, "eos_token_id": 1, "pad_token_id": 1}
    ids = target.generate(torch.tensor([prompt]), max_new_tokens=head, **kwargs)[0].tolist() if head else prompt
    if ids[-1] == 1 and head:
        ids[-1] = 5  # keep going: the forced token must be read
    worst = int(target(torch.tensor([ids])).logits[0, -1].argmin())
    ids = ids + [worst if worst != 1 else 2]
    out = target.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS - head - 1, **kwargs)[0].tolist()
    return out[len(prompt) :]


def test_no_sample_is_dropped_for_a_token_outside_dflash_support(project, tmp_path):
    """The first completion token (drawn at prefill, never verified) is taken as given, however unlikely under
    dflash's filter; a verified token outside the support is scored as a rejected draft at its anchor (alpha 0), the
    sample kept, and counted per dataset beside the rejection tau."""
    root, records, settings = project
    target = tiny_target()
    with torch.no_grad():
        changed = [
            dict(records[0], completion_token_ids=_forced(target, records[0]["prompt_token_ids"], 0, 7)),
            dict(records[1], completion_token_ids=_forced(target, records[1]["prompt_token_ids"], 3, 8)),
        ]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed + records[2:]))
    (odd / "target").symlink_to(root / "target")
    (odd / "drafter").symlink_to(root / "drafter")
    extract = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "shard_tokens": 24,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
        "target_logprobs": True,
        "target": {"path": str(root / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
    }
    extract_stage.extract(extract, odd / "c.jsonl", odd / "hidden")
    code, log = _evaluate(odd, {**settings, "verify": ["target_only", "rejection"]}, tmp_path / "out")
    assert code == 0, log
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["diagnostics"]["samples_skipped"] == []
    section = metrics["rejection"]
    assert section["outside_support"]["samples"] == 1 and section["outside_support"]["tokens"] == 1
    assert section["outside_support"]["samples_scored"] == 4
    for block in (BLOCK, SHORT):
        chain = section["methods"][f"chain-B{block}"]
        assert chain["samples"] == 4
        for row, record in zip(chain["per_sample"], changed + records[2:]):
            assert row["expected_tau"] == pytest.approx(_reference_expected_tau(odd, record, block), rel=1e-5)


def test_a_penalized_record_is_refused_by_the_rejection_scheme():
    """The cache's p_T applies no penalty, SGLang's verify does: a record served penalized cannot be scored."""
    from dflash_eval.errors import DflashEvalError
    from dflash_eval.evaluate import rejection_metrics

    record = {"id": "p0#s0", "sampling": SAMPLING, "request": {"repetition_penalty": 1.1, "presence_penalty": 0.0}}
    stored = {"sampling": {"p0#s0": {k: v for k, v in SAMPLING.items() if k != "seed"}}}
    with pytest.raises(DflashEvalError, match=r"repetition_penalty.*1\.1.*verify: target_only"):
        rejection_metrics.sample_params(stored, record, "c.jsonl")
    record["request"]["repetition_penalty"] = 1.0
    assert rejection_metrics.sample_params(stored, record, "c.jsonl").top_k == SAMPLING["top_k"]


def test_a_dflash2_drafter_on_sampled_completions_is_refused_by_the_stage(project, tmp_path):
    """Under either scheme: its target_only number would be the greedy selector's, which no engine serves at T > 0."""
    root, _, settings = project
    tiny_drafter(LAYERS, block_size=BLOCK, dflash2=True).save_pretrained(tmp_path / "d2", safe_serialization=True)
    checkpoint = {**settings["checkpoint"], "path": str(tmp_path / "d2")}
    code, log = _evaluate(root, {**settings, "checkpoint": checkpoint}, tmp_path / "out")
    assert code != 0 and "is a DFlash2DraftModel, and datasets toy sample" in log, log


def test_a_cache_of_another_model_is_flagged_at_t_above_0(project, tmp_path):
    """Argmax agreement checks nothing at T > 0; the support share does: the served tokens lie inside the serving
    target's top-k/top-p support, and far less often inside another model's (same config, other weights)."""
    root, _, settings = project
    code, log = _evaluate(root, {**settings, "verify": ["target_only", "rejection"]}, tmp_path / "same")
    assert code == 0, log
    same = json.loads((tmp_path / "same" / "metrics.json").read_text())["diagnostics"]["sampled_check"]
    assert same["support_share"] == 1.0 and same["suspect"] == []
    other = tmp_path / "other"
    tiny_target(seed=3).save_pretrained(other / "target")
    extract = {
        "dataset": "toy",
        "layer_ids": LAYERS,
        "shard_tokens": 24,
        "store_argmax": True,
        "strict_tokens": False,
        "server": None,
        "target_logprobs": True,
        "target": {"path": str(other / "target"), "dtype": "float32", "device": "cpu", "backend": "torch"},
    }
    extract_stage.extract(extract, root / "c.jsonl", other / "hidden")
    (other / "c.jsonl").symlink_to(root / "c.jsonl")
    code, log = _evaluate(
        other,
        {**settings, "verify": ["target_only", "rejection"], "target": {"path": str(other / "target")}},
        tmp_path / "out",
    )
    assert code == 0, log
    check = json.loads((tmp_path / "out" / "metrics.json").read_text())["diagnostics"]["sampled_check"]
    assert check["support_share"] < 0.95 and "support" in check["suspect"][0], check
