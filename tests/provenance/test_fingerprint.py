"""Content fingerprints and stage code fingerprints."""

from __future__ import annotations

import hashlib
import os

import pytest

from dflash_eval.errors import DflashEvalError
from dflash_eval.provenance import code_version, fingerprint, identity


def test_file_hash_is_sha256_and_cached_by_size_and_mtime(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc" * 1000)
    cache = fingerprint.FingerprintCache(tmp_path / "cache.json")
    assert cache.file(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
    reads = []
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p: reads.append(p) or "x")
    fresh = fingerprint.FingerprintCache(tmp_path / "cache.json")  # from the file, as a new Snakemake process
    assert fresh.file(path) == hashlib.sha256(b"abc" * 1000).hexdigest() and reads == []
    os.utime(path, ns=(1, 1))  # touched: same size, other mtime -> hashed again
    assert fresh.file(path) == "x" and len(reads) == 1


def test_directory_fingerprint_depends_on_names_and_contents_not_order(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"2")
    cache = fingerprint.FingerprintCache(tmp_path / "cache.json")
    both = cache.files([str(tmp_path / "a"), str(tmp_path / "b")])
    assert both == cache.files([str(tmp_path / "b"), str(tmp_path / "a")])
    (tmp_path / "b").write_bytes(b"3")
    assert cache.files([str(tmp_path / "a"), str(tmp_path / "b")]) != both


def test_missing_file_names_the_config_key(tmp_path):
    with pytest.raises(DflashEvalError, match=r"drafters.v4.path: .*nope.pt does not exist"):
        fingerprint.FingerprintCache(tmp_path / "c.json").file(tmp_path / "nope.pt", "drafters.v4.path")


def test_stage_modules_follow_imports_transitively():
    evaluate = code_version.stage_modules("evaluate")
    assert {
        "evaluate.stage",
        "evaluate.trajectory",
        "evaluate.ddtree",
        "evaluate.acceptance",
        "evaluate.drafter",
        "io_utils",
    } <= set(evaluate)
    assert "fetch.stage" not in evaluate and "report.stage" not in evaluate
    assert "evaluate.trajectory" not in code_version.stage_modules("report")
    # the rejection scheme (issue 25) reads the drafter's block at every anchor through all_anchor.anchor_blocks, so
    # an edit there changes what evaluate computes and must rerun it
    assert {"evaluate.all_anchor", "evaluate.rejection", "evaluate.rejection_metrics"} <= set(evaluate)
    assert "server.control" in code_version.stage_modules("extract")


def test_stage_fingerprints_cover_the_shared_ground_they_run():
    """Code moved out of a stage into shared ground stays in the fingerprints of the stages that run it."""
    evaluate, report, extract = (set(code_version.stage_modules(s)) for s in ("evaluate", "report", "extract"))
    assert {"methods", "stats", "speedup.timing", "target_identity"} <= evaluate
    # the estimate is made in the report from metrics.json and the target's profile; evaluation reads no profile
    assert not {"speedup.model", "cache.serving_profile"} & evaluate
    assert {"methods", "stats", "speedup.labels", "speedup.model", "cache.serving_profile"} <= report
    assert "evaluate.stage" not in report
    # the target is timed by its own rule (profile-target): extraction is about hidden states
    extract_decides = set(identity.STAGES["extract"].decides)
    # (methods is imported, for the scheme names extract.settings reads evaluation.verify by, and decides nothing)
    assert "target_identity" in extract and "tools.target_timing" not in extract and "methods" not in extract_decides
    assert not {"speedup.timing", "speedup.forwards.hybrid_target", "speedup.forwards.target"} & extract_decides
    assert {"tools.target_timing", "speedup.timing", "extract.backends"} <= set(
        code_version.stage_modules("profile-target")
    )
    assert "cli" not in set().union(*(code_version.stage_modules(s) for s in code_version.STAGE_MODULES))
