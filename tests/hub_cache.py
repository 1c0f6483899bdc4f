"""A Hugging Face hub cache laid out by hand, as huggingface_hub writes one:
models--ORG--NAME/{blobs/<hash>, refs/<branch>, snapshots/<commit>/<file> -> ../../blobs/<hash>}."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_cache(cache: Path, repo_id: str, source: Path, commit: str, branch: str | None = "main") -> Path:
    """Every file of `source` as the snapshot `commit` of `repo_id`; `branch` points at it. Returns
    the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    if branch is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot
