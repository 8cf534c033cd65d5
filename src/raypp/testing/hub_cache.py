"""Lay out a Hugging Face Hub cache on disk, as ``huggingface_hub`` does, from local files,
so tests resolve Hub ids with ``HF_HUB_OFFLINE=1`` and no network.

The layout (``huggingface_hub``'s cache format)::

    <cache>/models--<org>--<name>/blobs/<hash>                  the files' bytes
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>     relative links to the blobs
    <cache>/models--<org>--<name>/refs/<revision>               the commit, no newline
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_to_hub_cache(cache: str | Path, repo_id: str, files: dict[str, Path],
                     revision: str = "main", link: bool = False) -> str:
    """Store ``files`` (name in the repo -> local file) as one commit of ``repo_id`` in the
    hub cache ``cache``, with ``refs/<revision>`` naming it; returns the commit (40 hex
    digits, derived from the contents). ``link``: each blob is a link to the local file
    instead of a copy (for large files)."""
    digests = {name: _sha256(path) for name, path in sorted(files.items())}
    commit = hashlib.sha1("".join(f"{n}:{d}\n" for n, d in digests.items()).encode()).hexdigest()
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    for name, digest in digests.items():
        blob = blobs / digest
        if not blob.exists():
            if link:
                blob.symlink_to(Path(files[name]).resolve())
            else:
                shutil.copyfile(files[name], blob)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_symlink():
            target.symlink_to(os.path.relpath(blob, target.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def add_model_dir_to_hub_cache(cache: str | Path, repo_id: str, model_dir: Path,
                               revision: str = "main") -> str:
    """Every file at the top of ``model_dir`` (a checkpoint directory) as one commit."""
    files = {p.name: p for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
    return add_to_hub_cache(cache, repo_id, files, revision)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
