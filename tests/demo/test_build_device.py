"""demo.build_device: the demo's target and drafters train on the device named, the CPU build unchanged by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_eval.demo import build_device, drafters, target
from dflash_eval.errors import DflashEvalError
from tests.support.tiny import build_demo_target


def test_the_cpu_leaves_torch_as_it_is():
    assert build_device.prepare_build_device("cpu") == torch.device("cpu")
    assert not torch.are_deterministic_algorithms_enabled()  # the CPU's bits stay the thread count's


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", ""])
def test_a_bad_device_is_named_with_the_key(bad):
    with pytest.raises(DflashEvalError, match=r"demo.build_device"):
        build_device.prepare_build_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_cuda_torch_says_what_to_set():
    with pytest.raises(DflashEvalError, match=r"demo.build_device is 'cuda:0' .*set demo.build_device: cpu"):
        build_device.prepare_build_device("cuda:0")


def small_drafters(target_dir: Path, out: Path, device: str) -> dict:
    return drafters.build_drafters(
        target_dir, out, [2, 3], seed=0, sequences=2, max_new_tokens=8, anchors_per_seq=4, device=device
    )


def test_a_drafter_build_on_the_named_device_repeats_itself_and_saves_cpu_tensors(tmp_path):
    """The device is a parameter of the same code: on the CPU two builds give the same bits, and the .pt
    checkpoints hold CPU tensors (a CUDA build's load on any machine)."""
    target_dir = build_demo_target(tmp_path / "target")
    torch.set_num_threads(2)
    info = small_drafters(target_dir, tmp_path / "a", "cpu")
    small_drafters(target_dir, tmp_path / "b", "cpu")
    assert info["device"] == "cpu"
    for name in ("untrained", "step2", "step3"):
        a = load_file(tmp_path / "a" / name / "model.safetensors")
        b = load_file(tmp_path / "b" / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    trained, start = (
        load_file(tmp_path / "a/step3/model.safetensors"),
        load_file(tmp_path / "a/untrained/model.safetensors"),
    )
    assert any(not torch.equal(trained[k], start[k]) for k in trained)  # it did train
    checkpoint = torch.load(tmp_path / "a/checkpoints/step_3.pt", weights_only=True)
    assert {t.device.type for t in checkpoint["model_state_dict"].values()} == {"cpu"}


def test_the_target_build_records_its_device_and_trains_on_it(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    from dflash_eval.demo.tokenizer import build_tokenizer

    build_tokenizer(tokenizer_dir, seed=0, vocab_size=512, corpus_bytes=200_000)
    settings = target.TrainSettings(steps=2, batch_size=2, seq_len=32, warmup=1, corpus_bytes=200_000)
    info = target.build_target(tokenizer_dir, tmp_path / "t", settings=settings, device="cpu")
    assert info["device"] == "cpu" and info["train"]["steps"] == 2
    weights = load_file(tmp_path / "t" / "model.safetensors")
    assert {t.device.type for t in weights.values()} == {"cpu"}


def test_a_cuda_build_turns_on_what_makes_it_repeat_itself(monkeypatch):
    """The CUDA branch on a CPU machine (CUDA's presence faked): deterministic algorithms, cuBLAS's fixed
    workspace, no TF32, attention by the math kernel. Every global it sets is put back after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a faked GPU")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for flag in ("deterministic", "benchmark", "allow_tf32"):
        monkeypatch.setattr(torch.backends.cudnn, flag, getattr(torch.backends.cudnn, flag))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    sdp = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    try:
        assert build_device.prepare_build_device("cuda:1") == torch.device("cuda:1")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert build_device.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert not (
            torch.backends.cuda.flash_sdp_enabled()
            or torch.backends.cuda.mem_efficient_sdp_enabled()
            or torch.backends.cuda.cudnn_sdp_enabled()
        )
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.enable_flash_sdp(sdp["flash"])
        torch.backends.cuda.enable_mem_efficient_sdp(sdp["mem_efficient"])
        torch.backends.cuda.enable_cudnn_sdp(sdp["cudnn"])
