"""The target's step profile, measured on a tiny hybrid target: the format evaluate reads."""

from dflash_eval.cache.serving_profile import PROFILE_NAME, load_profile
from dflash_eval.extract.profile import measure_target, write_target_profile
from tests.support.tiny import tiny_target


def test_measured_profile_is_a_valid_profile(tmp_path):
    profile = measure_target(tiny_target().eval(), context_tokens=32, repeats=2, verify_tokens=[2, 5])
    assert sorted(profile["t_verify_ms"]) == ["1", "2", "5"] and profile["t_ar_ms"] == profile["t_verify_ms"]["1"]
    for n, (low, high) in profile["spread"]["t_verify_ms"].items():
        assert 0 < low <= profile["t_verify_ms"][n] <= high
    path = write_target_profile(tiny_target().eval(), tmp_path, {"context_tokens": 16, "repeats": 1, "measure": True})
    assert path == tmp_path / PROFILE_NAME and load_profile(path)["t_verify_ms"][1] > 0
    assert write_target_profile(tiny_target(), tmp_path / "off", {"measure": False}) is None
    assert write_target_profile(tiny_target(), tmp_path / "off", {"measure": "auto"}) is None  # a CPU target


def test_a_failed_timing_only_warns_and_writes_nothing(tmp_path, monkeypatch, caplog):
    from dflash_eval.extract import profile

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(profile, "measure_target", broken)
    assert write_target_profile(tiny_target(), tmp_path, {"measure": True, "context_tokens": 16, "repeats": 1}) is None
    assert not (tmp_path / PROFILE_NAME).exists() and "timing the target failed (RuntimeError: out of memory)" in caplog.text
