"""server_paused: the server is paused around a target's GPU work (extraction, profile_target) only where it shares
that GPU (server.shares_target_gpu, true by default); a server elsewhere keeps serving, untouched and unrecorded.
profile-server's block pauses it wherever it runs (its variants take the server's port)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dflash_eval.server.control import ServerController, ServerError, server_paused
from tests.support import servers as hs
from tests.support.server_control import make, transitions


def test_the_default_server_shares_the_gpu_and_is_paused_as_extraction_pauses_it(tmp_path, controllers):
    ctl = make(controllers, hs.tiny_helper_settings(tmp_path / "logs"))
    assert ctl.settings["shares_target_gpu"] is True  # the schema's default: the safe one
    ctl.ensure_up()
    with server_paused(ctl.settings):
        assert not ctl.is_healthy()
        assert ctl.current_outage() is not None
    assert ctl.is_healthy() and ctl.current_outage() is None
    assert {"pause", "extraction_start", "extraction_end", "resume"} <= set(transitions(tmp_path / "logs"))


def test_a_server_off_the_target_gpu_keeps_serving_through_the_block(tmp_path, controllers):
    settings = {**hs.tiny_helper_settings(tmp_path / "logs"), "shares_target_gpu": False}
    ctl = make(controllers, settings)
    ctl.ensure_up()
    pid, before = ctl.launched_pid(), transitions(tmp_path / "logs")
    with server_paused(ctl.settings, work="extraction"):
        assert ctl.is_healthy() and ctl.launched_pid() == pid
        assert ctl.current_outage() is None
        ctl.ensure_up()  # a fetch meanwhile finds it up, waits for nothing
    assert ctl.is_healthy() and ctl.launched_pid() == pid
    assert transitions(tmp_path / "logs") == before  # no pause, no restart, nothing recorded


def test_profile_server_s_block_pauses_a_server_off_the_target_gpu_too(tmp_path, controllers):
    settings = {**hs.tiny_helper_settings(tmp_path / "logs"), "shares_target_gpu": False}
    ctl = make(controllers, settings)
    ctl.ensure_up()
    with server_paused(ctl.settings, work="profile"):
        assert not ctl.is_healthy() and ctl.current_outage() is not None
    assert ctl.is_healthy() and ctl.current_outage() is None
    assert {"pause", "profile_start", "profile_end", "resume"} <= set(transitions(tmp_path / "logs"))


def test_the_release_memory_check_still_guards_a_server_that_shares_the_gpu(tmp_path):
    """A release server whose GPU memory does not drop still stops the block before it starts (the default)."""
    settings = hs.tiny_helper_settings(tmp_path / "logs")
    proc = subprocess.Popen(settings["command"], shell=True)
    release = {
        "kind": "release",
        "base_url": settings["base_url"],
        "log_dir": str(tmp_path / "logs"),
        "health_timeout_s": 30.0,
        "release_check_s": 1.0,
        "memory_probe": f"echo {hs.BUSY_MIB}",
    }
    try:
        ServerController(release).ensure_up()
        with pytest.raises(ServerError, match="did not drop"), server_paused(release):
            pytest.fail("the target must not load while the server still holds the GPU")
    finally:
        proc.kill()
        proc.wait()


def test_the_setting_is_a_boolean(tmp_path: Path):
    with pytest.raises(Exception, match="shares_target_gpu"):
        with server_paused({**hs.tiny_helper_settings(tmp_path / "logs"), "shares_target_gpu": "no"}):
            pytest.fail("a bad setting must stop the block before it starts")
