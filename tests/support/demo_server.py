"""The demo server (`dflash-eval demo-server`) of servers.build_tiny_target's target, speculating with a tiny
DFlash drafter: the real SGLang-protocol server of the fetch, demo-server and profile-server tests."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_eval.testing.fixtures import free_port
from tests.support.servers import build_tiny_target
from tests.support.tiny import tiny_drafter_config

BLOCK = 4  # the drafter's block and the server's --speculative-num-draft-tokens


def tiny_drafter_dir(target_dir: Path, out: Path, layer_ids: Sequence[int] = (0,), scale: float | None = 0.2) -> Path:
    """A DFlash drafter (block BLOCK) for the target in `target_dir`, saved as an HF directory; `scale`: the std its
    matrices are redrawn with (drafts that are sometimes accepted), None keeps the initialisation."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_dir)
    config = tiny_drafter_config(list(layer_ids), block_size=BLOCK, num_target_layers=target_config.num_hidden_layers)
    config.vocab_size = target_config.vocab_size
    config.dflash_config["mask_token_id"] = target_config.pad_token_id
    torch.manual_seed(3)
    model = DFlashDraftModel(config).eval()
    if scale is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0, scale)
    model.save_pretrained(out)
    return out


def demo_server_command(
    target: Path | str, drafter: Path | str, port: int, env: str = "", extra: str = "", algorithm: str = "DFLASH"
) -> str:
    """The managed server command of the demo server on `port`, single-threaded, with `env` before and `extra`
    after the SGLang flags."""
    return " ".join(
        part
        for part in (
            env,
            f"OMP_NUM_THREADS=1 exec {sys.executable} -m dflash_eval.cli demo-server --model-path {target}",
            f"--port {port} --speculative-algorithm {algorithm} --speculative-draft-model-path {drafter}",
            f"--speculative-num-draft-tokens {BLOCK}",
            extra,
        )
        if part
    )


def demo_server(base: Path, env: str = "", extra: str = "", algorithm: str = "DFLASH") -> tuple[dict, Path, Path]:
    """A tiny target and drafter under `base` and managed-server settings serving them on a free port: (settings,
    target directory, drafter directory). Nothing is started."""
    target = build_tiny_target(base / "target")
    drafter = tiny_drafter_dir(target, base / "drafter")
    port = free_port()
    settings = {
        "kind": "managed",
        "base_url": f"http://127.0.0.1:{port}",
        "model": None,
        "command": demo_server_command(target, drafter, port, env, extra, algorithm),
        "health_timeout_s": 120.0,
        "stop_grace_s": 5.0,
        "log_dir": str(base / "logs"),
    }
    return settings, target, drafter
