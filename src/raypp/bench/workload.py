"""Benchmark requests: synthetic fixed-length prompts or a JSONL dataset.

Every request's output is forced to its length (``ignore_eos`` + ``max_tokens``),
so runs are comparable whatever the model says.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raypp.sampling_params import SamplingParams


@dataclass
class BenchRequest:
    """One request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.output_len, ignore_eos=True)


def synthetic_requests(num: int, input_len: int, output_len: int, vocab_size: int,
                       avoid: set[int], seed: int = 0, shared_prefix_len: int = 0
                       ) -> list[BenchRequest]:
    """``num`` prompts of random token ids (never one in ``avoid``): the same
    ``shared_prefix_len`` tokens first in every prompt (a system prompt), then
    ``input_len`` of its own."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    prefix = [rng.choice(allowed) for _ in range(shared_prefix_len)]
    return [BenchRequest(prefix + [rng.choice(allowed) for _ in range(input_len)], output_len)
            for _ in range(num)]


def dataset_requests(path: str | Path, tokenizer: Any, default_output_len: int,
                     num: int | None = None) -> list[BenchRequest]:
    """Requests from a JSONL file, one object a line.

    Each line has ``"prompt"`` (text, tokenized here) or ``"prompt_token_ids"``,
    and optionally ``"output_len"`` (else ``default_output_len``). ``num`` keeps
    the first ``num`` lines. ``ValueError`` names the line of a malformed entry.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    out: list[BenchRequest] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        if "prompt_token_ids" in entry:
            ids = [int(t) for t in entry["prompt_token_ids"]]
        elif "prompt" in entry:
            ids = tokenizer.encode(entry["prompt"])
        else:
            raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
        out.append(BenchRequest(ids, int(entry.get("output_len", default_output_len))))
        if num is not None and len(out) >= num:
            break
    if not out:
        raise ValueError(f"dataset {str(path)!r} holds no requests")
    return out


def special_token_ids(tokenizer: Any, eos_ids: set[int]) -> set[int]:
    """Ids a synthetic prompt should not contain (special tokens, EOS)."""
    return set(getattr(tokenizer, "all_special_ids", [])) | set(eos_ids)
