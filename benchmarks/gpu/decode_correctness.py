"""raypp's check tokens against transformers: fp32 greedy must be equal; bf16 is judged
by token agreement and by raypp's top-5 logprobs against transformers' logprobs
teacher-forced on raypp's own sequence (with transformers' bf16 vs fp32 as the yardstick)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.decode_hf import hf_greedy, hf_logprobs, hf_model
from benchmarks.gpu.decode_workload import CHECK_TOKENS, check_prompts


def correctness(ckpt: Path, fp32: dict | None, bf16: dict | None) -> dict[str, Any]:
    """Compare raypp's check results (:func:`~benchmarks.gpu.decode_engine.raypp_check`'s,
    either may be ``None``) with transformers fp32 and bf16 on the check prompts."""
    prompts = check_prompts()
    res: dict[str, Any] = {}
    model = hf_model(ckpt, torch.float32)
    hf32 = hf_greedy(model, prompts, CHECK_TOKENS)
    if fp32:
        equal = [a == b for a, b in zip(fp32["tokens"], hf32, strict=True)]
        res["fp32_greedy_equal"] = all(equal)
        res["fp32_per_prompt_equal"] = equal
        res["fp32_first_divergence"] = [_first_diff(a, b) for a, b in
                                        zip(fp32["tokens"], hf32, strict=True)]
        res["fp32_graphs"] = fp32["graphs"]
    ref32 = [hf_logprobs(model, p, o) for p, o in zip(prompts, bf16["tokens"], strict=True)] \
        if bf16 else None
    del model
    gc.collect()
    torch.cuda.empty_cache()
    model = hf_model(ckpt, torch.bfloat16)
    hf16 = hf_greedy(model, prompts, CHECK_TOKENS)
    res["hf_bf16_vs_fp32_first_divergence"] = [_first_diff(a, b) for a, b in
                                               zip(hf16, hf32, strict=True)]
    if bf16:
        res["bf16_first_divergence_vs_hf_bf16"] = [_first_diff(a, b) for a, b in
                                                   zip(bf16["tokens"], hf16, strict=True)]
        res["bf16_token_agreement_vs_hf_bf16"] = _agreement(bf16["tokens"], hf16)
        ref16 = [hf_logprobs(model, p, o) for p, o in zip(prompts, bf16["tokens"], strict=True)]
        res["bf16_logprob_rel_err_vs_hf_bf16"] = _logprob_err(bf16["top_logprobs"], ref16)
        res["bf16_logprob_rel_err_vs_hf_fp32"] = _logprob_err(bf16["top_logprobs"], ref32)
        res["hf_bf16_logprob_rel_err_vs_hf_fp32"] = _ref_err(ref16, ref32, bf16["top_logprobs"])
        res["bf16_graphs"] = bf16["graphs"]
    del model
    return res


def _first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len if equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a),
                                                                                       len(b)))


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=False))
    return round(same / sum(len(p) for p in a), 4)


def _logprob_err(top: list, refs: list[torch.Tensor]) -> dict[str, float]:
    """‖raypp − ref‖ / ‖ref‖ over raypp's top-k logprobs, and the largest absolute gap."""
    num = den = 0.0
    worst = 0.0
    for steps, ref in zip(top, refs, strict=True):
        for i, entries in enumerate(steps):
            for tid, lp in entries.items():
                r = ref[i, tid].item()
                num += (lp - r) ** 2
                den += r**2
                worst = max(worst, abs(lp - r))
    return {"rel": round((num / den) ** 0.5, 6) if den else 0.0, "max_abs": round(worst, 5)}


def _ref_err(ref16: list[torch.Tensor], ref32: list[torch.Tensor], top: list) -> dict[str, float]:
    as_top = [[{tid: r16[i, tid].item() for tid in entries} for i, entries in enumerate(steps)]
              for steps, r16 in zip(top, ref16, strict=True)]
    return _logprob_err(as_top, ref32)
