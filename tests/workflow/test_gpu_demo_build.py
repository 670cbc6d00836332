"""demo.build_device cuda (config/gpu.yaml): the demo's target and drafters trained on the GPU repeat
themselves bit for bit on the same machine, with one or several processes computing the training completions on the
GPU, save CPU tensors, and train (a saved step differs from the start). Run on a GPU machine: python -m pytest -m gpu tests/workflow/test_gpu_demo_build.py"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu


def build(out: Path, device: str, workers: int = 1) -> None:
    """The workflow's CLI calls (demo.smk), small: a new process each, as the rules run them."""
    cli = [sys.executable, "-m", "dflash_eval.cli"]
    subprocess.run([*cli, "demo-tokenizer", "--out", str(out / "tok"), "--seed", "0"], check=True)
    subprocess.run(
        [*cli, "demo-target", "--tokenizer", str(out / "tok"), "--out", str(out / "target"), "--steps", "20"]
        + ["--device", device],
        check=True,
    )
    subprocess.run(
        [*cli, "demo-drafters", "--target", str(out / "target"), "--out", str(out / "drafters"), "--steps", "30"]
        + ["--sequences", "4", "--device", device, "--workers", str(workers)],
        check=True,
    )


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_build_repeats_itself_and_loads_anywhere(tmp_path):
    build(tmp_path / "a", "cuda:0")
    build(tmp_path / "b", "cuda:0", workers=3)
    assert same_weights(tmp_path / "a/target/model.safetensors", tmp_path / "b/target/model.safetensors")
    for name in ("untrained", "step30"):
        assert same_weights(
            tmp_path / f"a/drafters/{name}/model.safetensors", tmp_path / f"b/drafters/{name}/model.safetensors"
        )
    checkpoint = torch.load(tmp_path / "a/drafters/checkpoints/step_30.pt", weights_only=True)
    assert {t.device.type for t in checkpoint["model_state_dict"].values()} == {"cpu"}
    trained = load_file(tmp_path / "a/drafters/step30/model.safetensors")
    start = load_file(tmp_path / "a/drafters/untrained/model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in trained)
