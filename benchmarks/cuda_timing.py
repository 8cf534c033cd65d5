"""Timing on the GPU: CUDA-event medians, CUDA-graph replays, and the HBM bandwidth the
rooflines divide by. Every function here needs CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after ``warmup``, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def graph_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Seconds per ``fn`` call: ``fn`` runs once (compiling), then ``reps`` calls are
    captured in one CUDA graph and its replay is timed (:func:`time_cuda`, 20 runs), so
    launches cost what they cost inside a decode replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_cuda(graph.replay, 20) / reps


def bandwidth() -> dict[str, float]:
    """``copy_GBps`` (bytes read + written by a 2 GiB bf16 copy) and ``read_GBps`` (a sum
    over the same 2 GiB), far above any L2."""
    n = 2**30
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t_copy = time_cuda(lambda: y.copy_(x), 20)
    t_read = time_cuda(lambda: x.sum(dtype=torch.float32), 20)
    return {"copy_GBps": 2 * x.nbytes / t_copy / 1e9, "read_GBps": x.nbytes / t_read / 1e9}
