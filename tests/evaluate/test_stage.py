"""The evaluate stage's own helpers (the evaluation itself is tested through tests/workflow and tests/demo)."""

from __future__ import annotations

import hashlib

from dflash_eval.provenance import fingerprint


def test_checkpoint_hash_keeps_the_recorded_format_and_reads_each_file_once(tmp_path, monkeypatch):
    """metrics.json's checkpoint.sha256 as before (a file's sha256; for a directory the sha256 of its
    files' hex digests in path order), with each file hashed once through the FingerprintCache."""
    monkeypatch.chdir(tmp_path)  # the FingerprintCache file lives under the working directory's .snakemake/
    single = tmp_path / "drafter.pt"
    single.write_bytes(b"weights")
    directory = tmp_path / "ckpt"
    files = {"config.json": b"{}", "model.safetensors": b"x" * 1000, "sub/extra.bin": b"y"}
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    expected_dir = hashlib.sha256(
        "".join(hashlib.sha256(files[name]).hexdigest() for name in sorted(files)).encode()
    ).hexdigest()
    reads = []
    real = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda path: reads.append(path) or real(path))
    assert fingerprint.checkpoint_sha256(str(single)) == hashlib.sha256(b"weights").hexdigest()
    assert fingerprint.checkpoint_sha256(str(directory)) == expected_dir
    assert len(reads) == 4
    assert fingerprint.checkpoint_sha256(str(directory)) == expected_dir and len(reads) == 4  # cached by size and mtime
