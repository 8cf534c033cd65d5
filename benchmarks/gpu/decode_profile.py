"""Kernel time per decode step of the in-process stage, by category, from the PyTorch
profiler; each profile's kernel table is also written as ``profile_b{batch}_k{k}.txt``."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu.decode_workload import PROMPT_LEN, random_prompts
from benchmarks.gpu.stage_harness import StageHarness
from benchmarks.harness import Run, log

_CATEGORIES = (
    ("attention: paged decode (Triton)", ("_paged_decode", "_combine_kernel", "_rope_decode")),
    ("kv cache store (Triton)", ("_store_kv",)),
    ("gemm / gemv (Triton GEMV at batch 1, Triton GEMM at 2..64, cuBLAS above)",
     ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "splitk", "cublas", "matmul")),
    ("memcpy / memset", ("memcpy", "memset")),
    ("argmax / sampling", ("argmax", "sort", "topk", "softmax", "cumsum", "log_")),
    ("elementwise: norm, rotary, silu, casts", ("elementwise", "vectorized", "reduce", "_rms_norm",
                                                "unrolled", "index", "cat", "copy", "fill",
                                                "embedding")),
)


def _categorize(name: str) -> str:
    if name.startswith("triton_"):  # Inductor's fused kernels (names list the fused ops)
        return "elementwise: norm, rotary, silu, casts"
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profiles(h: StageHarness, run: Run) -> dict[str, Any]:
    """Kernel time per decode step at batch 1 and 64: one step per call, and 16 steps
    per call; stops when less than 20 s are left."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for batch, k in ((1, 1), (1, 16), (64, 16), (64, 1)):
        if run.left() < 20:
            break
        tag = f"b{batch}_k{k}"
        tokens = h.prefill(random_prompts(batch, PROMPT_LEN, 500 + batch))
        lengths = [PROMPT_LEN] * batch
        for i in range(2):  # warm
            tokens, lengths = h.decode(tokens, lengths, 1 + i * k, k)
        calls = max(1, 32 // k)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                tokens, lengths = h.decode(tokens, lengths, (2 + i) * k + 1, k)
            torch.cuda.synchronize()
        out[tag] = _kernel_summary(prof, calls * k)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40,
                                          max_name_column_width=90)
        (run.out / f"profile_{tag}.txt").write_text(table)
        log(f"profile {tag}: {out[tag]['per_step_ms_by_category']}")
    return out


def _kernel_summary(prof: Any, steps: int) -> dict[str, Any]:
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):  # a kernel, memcpy or memset
            us = e.time_range.elapsed_us()
            entry = kernels.setdefault(e.name, [0.0, 0])
            entry[0] += us
            entry[1] += 1
    by_cat: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        cat = _categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    total = sum(us for us, _ in kernels.values())
    return {
        "kernel_ms_per_step": round(total / 1e3 / steps, 3),
        "kernels_per_step": round(sum(c for _, c in kernels.values()) / steps, 1),
        "per_step_ms_by_category": {k: round(v / 1e3 / steps, 3)
                                    for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "ms_per_step": round(us / 1e3 / steps, 4),
                         "launches_per_step": round(c / steps, 1)} for n, (us, c) in top],
    }
