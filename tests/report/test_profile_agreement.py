"""Step profiles of one target on one device taken by different extractions: the report warns where they disagree
(the GPU demo's two extractions timed T_AR at 15.5 and 7.3 ms: benchmarks/results/gpu_demo.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_eval.evaluate import speedup
from dflash_eval.io_utils import atomic_write_json
from dflash_eval.report import profile_agreement
from dflash_eval.report import stage as report
from dflash_eval.report.summary import read_metrics
from tests.support.report_inputs import report_args, section, write_metrics

TARGET = "qwen3_5_text 8 layers config 0123456789ab"


def profile(t_ar: float, verify8: float, device: str = "NVIDIA H200", context: int = 176,
            target: str = TARGET) -> dict:
    return {"t_ar_ms": t_ar, "t_verify_ms": {"2": verify8 * 0.9, "4": verify8, "9": verify8 * 1.1},
            "t_draft_ms": 2.0, "target": target, "device": device, "context_tokens": context, "method": "eager"}


def evaluated(root: Path, profiles: dict[str, dict], user_profile: Path | None = None) -> list[Path]:
    """The fixture's four evaluations, each estimated from its dataset's serving_profile.json (as the evaluate stage
    does), or from one user profile."""
    paths = write_metrics(root)
    for path in paths:
        metrics = json.loads(path.read_text())
        cache = Path(metrics["cache"]["dir"])
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "serving_profile.json").write_text(json.dumps(profiles[metrics["dataset"]]))
        settings = {"speedup": {"profile": str(user_profile)}} if user_profile else {}
        metrics["speedup"] = speedup.estimate(settings, cache, metrics["methods"],
                                              lambda _blocks, _trees, _method: pytest.fail("the profile gives t_draft_ms"))
        atomic_write_json(path, metrics)
    return paths


def test_two_extractions_of_one_target_that_disagree_are_a_warning(tmp_path):
    paths = evaluated(tmp_path, {"gsm8k": profile(15.5, 16.0), "humaneval": profile(7.33, 15.9)})
    assert report.run(report_args(tmp_path, paths)) == 0
    warnings = section((tmp_path / "summary.md").read_text(), "## ⚠️ Warnings")
    line = next(line for line in warnings.splitlines() if "**Step profiles disagree**" in line)
    gsm8k, humaneval = (str(tmp_path / "hidden" / d / "L1-3" / "serving_profile.json") for d in ("gsm8k", "humaneval"))
    assert f"T_AR 15.5 ms ({gsm8k}) against 7.33 ms ({humaneval}), 2.11x apart (1 of 4 sizes beyond 5%" in line
    assert TARGET in line and "NVIDIA H200" in line and "speedup.profile" in line
    trust = json.loads((tmp_path / "trust.json").read_text())["serving_profiles"]
    assert len(trust["profiles"]) == 2 and [d["worst"] for d in trust["disagreements"]] == ["T_AR"]
    assert trust["disagreements"][0]["sizes_beyond"] == ["T_AR"]


def test_a_verify_size_alone_that_disagrees_is_named(tmp_path):
    other = profile(10.2, 12.0)
    other["t_verify_ms"] = {**other["t_verify_ms"], "4": 12.7, "9": 12.0 * 1.1 * 1.08}
    paths = evaluated(tmp_path, {"gsm8k": profile(10.0, 12.0), "humaneval": other})
    found = profile_agreement.panel([read_metrics(p) for p in paths])["disagreements"]
    assert [(d["worst"], d["sizes_beyond"]) for d in found] == [("T_verify(9)", ["T_verify(4)", "T_verify(9)"])]
    assert found[0]["worst_ratio"] == pytest.approx(1.08) and found[0]["sizes_compared"] == 4


@pytest.mark.parametrize(("other", "why"), [
    (profile(10.4, 12.5), "within 5% everywhere"),
    (profile(20.0, 24.0, device="NVIDIA H100"), "another device"),
    (profile(20.0, 24.0, target="another target"), "another target"),
    (profile(20.0, 24.0, context=400), "a context over 1.25x longer: a real difference"),
])
def test_profiles_that_agree_or_are_not_comparable_are_no_warning(tmp_path, other, why):
    paths = evaluated(tmp_path, {"gsm8k": profile(10.0, 12.0), "humaneval": other})
    section_ = profile_agreement.panel([read_metrics(p) for p in paths])
    assert len(section_["profiles"]) == 2 and section_["disagreements"] == [], why


def test_one_user_profile_behind_every_estimate_has_nothing_to_compare(tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps(profile(10.0, 12.0)))
    paths = evaluated(tmp_path, {"gsm8k": profile(15.5, 16.0), "humaneval": profile(7.33, 15.9)}, user)
    assert profile_agreement.panel([read_metrics(p) for p in paths]) == {
        "tolerance": 0.05, "context_ratio": 1.25, "profiles": [], "disagreements": []}


def test_many_disagreeing_profiles_of_one_target_are_one_line():
    """Three datasets' profiles all apart: one line for the target, naming the pair furthest apart, not three."""
    profiles = [{"path": name, "target": TARGET, "device": "NVIDIA H200", "method": "graphs", "context_tokens": 176,
                 "t_ar_ms": t_ar, "t_verify_ms": {4: 12.0}} for name, t_ar in (("a", 10.0), ("b", 15.0), ("c", 7.0))]
    other = {**profiles[0], "path": "d", "target": "another target", "t_ar_ms": 30.0}
    section_ = {"tolerance": 0.05, "profiles": [*profiles, other],
                "disagreements": profile_agreement.disagreements([*profiles, other])}
    assert len(section_["disagreements"]) == 3  # every pair of the three; the other target has no pair
    [line] = profile_agreement.warnings(section_)
    assert line.startswith(f"**Step profiles disagree**: {TARGET} on NVIDIA H200: 3 pairs of profiles disagree, "
                           "T_AR 7-15 ms across 3; the furthest apart: T_AR 15 ms (b) against 7 ms (c), 2.14x apart")
