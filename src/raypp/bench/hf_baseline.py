"""``raypp bench throughput --compare-hf``: the same workload through transformers' ``generate``.

Same checkpoint, same dtype, same device, same prompts token for token; greedy; every
request generates exactly its ``output_len`` tokens (``max_new_tokens=output_len`` with
no EOS, the equivalent of raypp's ``ignore_eos``: an EOS token is emitted and decoding
goes on). Requests are batched ``batch_size`` at a time (requests of one output length
share a batch), left-padded to the batch's longest prompt with an attention mask.

The KV cache is ``dynamic`` (transformers' default, eager) or ``static`` (a fixed-size
cache; on CUDA transformers then compiles the forward with ``torch.compile``).
``auto`` is static on CUDA and dynamic on CPU. One untimed warm-up runs first: the
first batch in full with a static cache (so the compile happens there), else the first
batch for at most 4 tokens.

What a caller may rely on: :func:`run_hf_generate` returns an :class:`HfRun` whose
``output_token_ids[i]`` are the ids generated for ``requests[i]`` (exactly
``requests[i].output_len`` of them, else ``RuntimeError``), and whose ``elapsed_s``
covers the timed ``generate`` calls only (device synchronised).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from raypp.bench.workload import BenchRequest

CACHES = ("auto", "static", "dynamic")


@dataclass
class HfRun:
    """transformers' pass over the requests (see module docstring)."""

    cache: str
    compiled: bool
    batch_size: int
    elapsed_s: float = 0.0
    warmup_s: float = 0.0
    load_s: float = 0.0
    output_token_ids: list[list[int]] = field(default_factory=list)


def load_hf_model(model: str, dtype: Any, device: str) -> Any:
    """transformers' model of a checkpoint directory (or hub name), or of a GGUF file (or
    a directory holding one ``.gguf`` and no ``config.json``), in eval mode on ``device``."""
    import transformers

    path, kwargs = Path(model), {}
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.suffix == ".gguf":
        model, kwargs["gguf_file"] = str(path.parent), path.name
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **kwargs)
    return hf.to(device).eval()


def resolve_cache(cache: str, device: str) -> str:
    """``static`` or ``dynamic`` for ``--hf-cache`` on ``device``."""
    if cache not in CACHES:
        raise ValueError(f"--hf-cache must be one of {CACHES}, got {cache!r}")
    if cache == "auto":
        return "static" if device.startswith("cuda") else "dynamic"
    return cache


def _batches(requests: list[BenchRequest], batch_size: int) -> list[list[int]]:
    """Indices of ``requests`` in batches of at most ``batch_size``, one output length each."""
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_len.setdefault(r.output_len, []).append(i)
    return [idx[k:k + batch_size] for idx in by_len.values()
            for k in range(0, len(idx), batch_size)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate(model: Any, prompts: list[list[int]], new_tokens: int, cache: str,
              pad_id: int) -> list[list[int]]:
    """Greedy ``new_tokens`` after each prompt, left-padded into one batch."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    kwargs: dict[str, Any] = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=pad_id, **kwargs)
    return out[:, width:].tolist()


def _pad_id(model: Any) -> int:
    for cfg in (model.generation_config, model.config):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def run_hf_generate(model: Any, requests: list[BenchRequest], cache: str, batch_size: int,
                    device: str, progress: bool = False) -> HfRun:
    """Time ``generate`` over ``requests`` (see module docstring); ``model`` from
    :func:`load_hf_model`, ``cache`` from :func:`resolve_cache`."""
    if batch_size < 1:
        raise ValueError("--hf-batch-size must be >= 1")
    pad_id = _pad_id(model)
    # transformers compiles the forward itself when the cache is static on an accelerator
    run = HfRun(cache=cache, compiled=cache == "static" and not device.startswith("cpu"),
                batch_size=batch_size)
    batches = _batches(requests, batch_size)
    first = batches[0]
    warm = [requests[i].prompt_token_ids for i in first]
    start = time.perf_counter()
    _generate(model, warm, requests[first[0]].output_len if cache == "static"
              else min(4, requests[first[0]].output_len), cache, pad_id)
    _sync(device)
    run.warmup_s = time.perf_counter() - start
    outputs: dict[int, list[int]] = {}
    for batch in tqdm(batches, desc="bench transformers", dynamic_ncols=True,
                      disable=not progress):
        n = requests[batch[0]].output_len
        start = time.perf_counter()
        ids = _generate(model, [requests[i].prompt_token_ids for i in batch], n, cache, pad_id)
        _sync(device)
        run.elapsed_s += time.perf_counter() - start
        for i, row in zip(batch, ids, strict=True):
            if len(row) != n:
                raise RuntimeError(f"transformers generated {len(row)} tokens for request {i}, "
                                   f"not {n}")
            outputs[i] = row
    run.output_token_ids = [outputs[i] for i in range(len(requests))]
    return run


def token_agreement(raypp_ids: dict[int, list[int]], hf_ids: list[list[int]]) -> dict[str, Any]:
    """How many requests got identical ids from both; the first difference, if any."""
    identical, first = 0, None
    for i, theirs in enumerate(hf_ids):
        ours = raypp_ids.get(i)
        if ours == theirs:
            identical += 1
        elif first is None:
            ours = ours or []
            pos = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                       min(len(ours), len(theirs)))
            first = {"request": i, "position": pos,
                     "raypp": ours[pos] if pos < len(ours) else None,
                     "transformers": theirs[pos] if pos < len(theirs) else None}
    return {"requests": len(hf_ids), "identical": identical, "first_difference": first}
