"""The multi-GPU suites' checkpoints (built once under ``--model-root``, reused) and
check prompts."""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path
from typing import Any

from benchmarks.checkpoints import LLAMA_1B, LLAMA_8B, sharp_init_checkpoint
from benchmarks.gpu.multi_gpu_suites import Workload
from benchmarks.harness import log

# "tiny"/"small" use raypp.testing's sharp random init on the CPU (BPE tokenizer);
# "1b"/"8b" are Llama-3.2-1B / Llama-3-8B shapes built on the GPU with the same init
# recipe (so greedy argmaxes are decisive, not near-ties).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                  num_kv_heads=8, max_position_embeddings=2048),
    "1b": LLAMA_1B,
    "8b": LLAMA_8B,
}


def model_dir(spec: str | None, size: str, device: str, root: Path) -> Path:
    """``spec`` if given, else a checkpoint of ``size`` under ``root`` (built once, reused)."""
    if spec:
        return Path(spec)
    path = root / f"raypp-multi-gpu-{size}"
    if (path / "config.json").is_file():
        return path
    if size in ("1b", "8b") and device != "cuda":
        raise ValueError(f"--make-model {size} is built on a GPU; use tiny or small on CPU")
    log(f"building the {size} checkpoint in {path}")
    # in a child process: the driver must not hold a CUDA context on a stage's GPU
    proc = multiprocessing.get_context("spawn").Process(target=build_checkpoint,
                                                        args=(size, str(path)))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (path / "config.json").is_file():
        raise RuntimeError(f"building the {size} checkpoint failed (exit {proc.exitcode})")
    return path


def build_checkpoint(size: str, path: str) -> None:
    """Write a random-weight Llama checkpoint of ``size`` (see ``SHAPES``) to ``path``."""
    from raypp.testing.tiny_model import make_tiny_model

    if size in ("tiny", "small"):
        make_tiny_model(path, architecture="llama", seed=0, **SHAPES[size])
    else:
        sharp_init_checkpoint(Path(path), SHAPES[size])


def check_prompts(work: Workload, vocab: int) -> list[list[int]]:
    """One prompt of each of ``work.check_prompt_lens`` token ids below ``vocab`` (seed 7)."""
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in work.check_prompt_lens]
