"""A GPU user's install (`.[gpu]`: fla imports) on this CPU: every process that runs a hybrid target's forward on the
CPU binds the torch Gated DeltaNet path itself. Issue 27: on the H200 the demo build, the demo server, the tests'
`transformers serve` and two benchmark smokes failed with Triton's "cpu tensor?" refusal, because transformers binds
fla's kernels wherever fla imports. Here a stand-in fla (tests/support/fla_importable, on PYTHONPATH) refuses the same
way, so this runs without triton or a GPU. The first test proves the stand-in bites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dflash_eval.server.control import ServerController
from dflash_eval.testing.fixtures import free_port
from tests.support.servers import TORCH_SERVE, build_tiny_target

STAND_IN = Path(__file__).resolve().parents[1] / "support" / "fla_importable"


def _binds_fla_on_a_cpu() -> bool:
    """transformers 5.24 binds fla's kernels wherever fla imports; 5.17 only where CUDA is available (its
    is_flash_linear_attention_available), so there the GPU user's condition exists only on a GPU machine."""
    from importlib.metadata import version

    import torch
    from packaging.version import Version

    return Version(version("transformers")) >= Version("5.24") or torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _binds_fla_on_a_cpu(), reason="this transformers binds fla only with CUDA")
REFUSAL = "cannot be accessed from Triton (cpu tensor?)"
FORWARD = """
import sys, torch
from transformers import AutoModelForCausalLM
{bind}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    print(model(torch.tensor([[1, 2, 3, 4]])).logits.shape)
"""


def fla_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(STAND_IN), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("fla-importable") / "target")


def forward(target: Path, bind: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", FORWARD.format(bind=bind), str(target)],
        env=fla_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_stand_in_refuses_an_unbound_cpu_forward_and_the_torch_binding_runs_it(target):
    unbound = forward(target, "")
    assert unbound.returncode != 0 and REFUSAL in unbound.stderr, unbound.stderr[-2000:]
    bound = forward(target, "from dflash_eval.extract.backends import bind_backend; bind_backend('torch', 'cpu')")
    assert bound.returncode == 0, bound.stderr[-2000:]


def chat(base_url: str, model: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a function."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return json.loads(response.read())


def served(tmp_path: Path, command: str) -> dict:
    port = free_port()
    settings = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "command": f"PYTHONPATH={fla_env()['PYTHONPATH']} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 exec "
        + command.format(port=port),
        "health_timeout_s": 300.0,
        "stop_grace_s": 5.0,
        "log_dir": str(tmp_path / "logs"),
    }
    return settings


@pytest.mark.parametrize("server", ["demo-server", "transformers serve"])
def test_servers_of_a_cpu_target_answer_with_fla_importable(target, tmp_path, server):
    command = {
        "demo-server": f"{sys.executable} -m dflash_eval.cli demo-server --model-path {target} --port {{port}}",
        "transformers serve": f"{sys.executable} {TORCH_SERVE} serve --host 127.0.0.1 --port {{port}} "
        f"--device cpu {target}",
    }[server]
    settings = served(tmp_path, command)
    controller = ServerController(settings)
    try:
        controller.ensure_up()
        answer = chat(settings["base_url"], str(target))
    finally:
        controller.stop_if_launched()
    assert answer["choices"][0]["message"]["content"] is not None


def test_the_demo_models_train_with_fla_importable(tmp_path):
    tokenizer, out, drafters = tmp_path / "tokenizer", tmp_path / "target", tmp_path / "drafters"
    for args in (
        ["demo-tokenizer", "--out", str(tokenizer), "--seed", "0"],
        [
            "demo-target",
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--seed",
            "0",
            "--steps",
            "1",
            "--threads",
            "1",
        ],
        [
            "demo-drafters",
            "--target",
            str(out),
            "--out",
            str(drafters),
            "--steps",
            "1",
            "--seed",
            "0",
            "--threads",
            "1",
            "--sequences",
            "2",
        ],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "dflash_eval.cli", *args], env=fla_env(), capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "config.json").is_file() and any(drafters.iterdir())
