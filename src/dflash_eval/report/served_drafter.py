"""Which drafter the server speculated with, checked against the evaluated one: its method, its weights (where the
served path is readable here), its block size and the attention layout its engine resolves (report/served_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def weights_differ(served_path: str, checkpoint: dict[str, Any]) -> str | None:
    """None when the served weights are the checkpoint's, else how they differ.

    First the file sha256 evaluate records (metrics.json's checkpoint.sha256, through the fingerprint cache);
    when that differs and the checkpoint is readable here, the tensors themselves, names aside: the same
    weights are often served in another layout (the demo evaluates a .pt checkpoint and serves its HF export).
    """
    from dflash_eval.provenance.fingerprint import checkpoint_sha256

    digest = checkpoint_sha256(served_path)
    if digest == checkpoint.get("sha256"):
        return None
    ours = Path(str(checkpoint.get("path")))
    if ours.exists() and _tensors_digest(Path(served_path)) == _tensors_digest(ours):
        return None
    return (
        f"the served draft weights {served_path} (sha256 {digest[:12]}) are not {ours}'s (sha256 "
        f"{str(checkpoint.get('sha256'))[:12]}{', and their tensors differ' if ours.exists() else ''})"
    )


def _tensors_digest(path: Path) -> str:
    """A layout-free fingerprint of a checkpoint's tensors: the sorted (shape, dtype, sha256 of bytes) of each."""
    import hashlib

    import torch

    from dflash_eval.checkpoint import detect_layout
    from dflash_eval.checkpoint_weights import (
        read_state,  # imports torch: only for a readable served path
    )

    state, _ = read_state(path, detect_layout(path), allow_pickle=False)
    rows = sorted(
        f"{tuple(t.shape)}:{t.dtype}:{hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()}"
        for t in state.values()
    )
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def check_served_drafter(
    served: list[dict[str, Any]],
    checkpoint: dict[str, Any],
    own_block: int | None,
    allowed: bool,
    differ: Callable[[str, dict], str | None] = weights_differ,
) -> dict[str, Any]:
    """Whether the server speculates with report.served_drafter's checkpoint: algorithm DFLASH, and the draft
    weights equal where the served path is readable here (weights_differ), else the same directory name.

    Pairing the server's counters with another drafter's offline steps would compare two drafters and call
    it a fidelity check; so a mismatch refuses the pairing unless report.allow_served_drafter_mismatch.
    A served block size other than the drafter's own is a note, not a mismatch: the panel compares at the
    served block (chain-B<served>).
    """
    if not served:
        return {
            "status": "unverified",
            "problems": [],
            "notes": ["the completions record no speculative settings (the server did not answer /get_server_info)"],
            "refused": False,
            "allowed": allowed,
        }
    problems, notes, verified = [], [], True
    if len(served) > 1:
        problems.append(f"the records were served with {len(served)} different speculative settings")
    ours = str(checkpoint.get("path"))
    for setting in served:
        algorithm, path = setting.get("speculative_algorithm"), setting.get("speculative_draft_model_path")
        if algorithm != "DFLASH":
            problems.append(f"the server speculates with {algorithm!r}, not DFLASH")
        if path is None:
            problems.append("the server reports no speculative_draft_model_path")
            continue
        if Path(path).exists():
            difference = differ(path, checkpoint)
            if difference:
                problems.append(difference)
            # a record without an engine was served by SGLang (only vLLM's records name theirs)
            if (layout := _served_layout_problem(Path(path), setting.get("engine") or "sglang")) is not None:
                problems.append(layout)
        else:
            verified = False
            if Path(path).name != Path(ours).name:
                problems.append(f"the server speculates with {path}, not {ours} (not readable here, names differ)")
            else:
                notes.append(f"{path} is not readable here: the same name as {ours}, weights unverified")
        block = setting.get("speculative_num_draft_tokens")
        if own_block is not None and block is not None and int(block) != int(own_block):
            notes.append(f"served at block {block}, the drafter's own is {own_block}")
    status = "mismatch" if problems else "verified" if verified else "unverified"
    return {
        "status": status,
        "problems": problems,
        "notes": notes,
        "refused": bool(problems) and not allowed,
        "allowed": allowed,
    }


def _served_layout_problem(path: Path, engine: str) -> str | None:
    """Where the serving engine resolves the served checkpoint's attention layout otherwise than the offline
    drafter's rule (vLLM's); None for an engine whose rule is not known here."""
    import json

    from dflash_eval.report.served_layout import ENGINES, layout_difference

    if engine not in ENGINES:
        return None
    config_file = path / "config.json" if path.is_dir() else path.with_name("config.json")
    if not config_file.is_file():
        return None
    try:
        return layout_difference(json.loads(config_file.read_text()), engine)
    except ValueError as error:  # the engine or the evaluation would refuse the checkpoint
        return f"{config_file}: {error}"
