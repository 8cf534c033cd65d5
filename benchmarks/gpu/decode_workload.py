"""The decode benchmark's model, sizes and prompts: what every section (and the decode
probes) measure on, so that their numbers line up."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from benchmarks.checkpoints import LLAMA_1B, SPECIAL_TOKENS, hf_init_checkpoint

SHAPE_1B: dict[str, Any] = {**LLAMA_1B, "rms_norm_eps": 1e-5, **SPECIAL_TOKENS}
BATCHES = (1, 16, 64, 256)
PROMPT_LEN, OUTPUT_LEN = 512, 256
MAX_MODEL_LEN = 1024
CHECK_PROMPT_LENS = (7, 64, 200, 512)
CHECK_TOKENS = 32
CHECK_DECODE_STEPS = 8  # the correctness runs go through multi-step decode
DECODE_STEPS = (1, 8, 32, 64)  # engine runs: decode steps per round trip to the stage
SYNC_AB_STEPS, SYNC_AB_BATCHES = 32, (1, 64)  # runs repeated with async_scheduling off
MULTI_STEPS = 32  # decode steps per call in the stage's multi-step timing


def make_checkpoint(path: Path) -> dict[str, Any]:
    """A bf16 Llama checkpoint of Llama-3.2-1B's shape with transformers' random init,
    plus a word-level tokenizer; ``{"params", "weight_bytes", "config"}``."""
    return hf_init_checkpoint(path, SHAPE_1B)


def random_prompts(n: int, length: int, seed: int, vocab: int = SHAPE_1B["vocab_size"]
                   ) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in ``[3, vocab)`` (no special tokens; the 1B
    shape's vocabulary unless given), the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def check_prompts() -> list[list[int]]:
    """The correctness prompts, one of each length in ``CHECK_PROMPT_LENS``."""
    rng = random.Random(7)
    return [[rng.randrange(3, SHAPE_1B["vocab_size"]) for _ in range(n)] for n in CHECK_PROMPT_LENS]
