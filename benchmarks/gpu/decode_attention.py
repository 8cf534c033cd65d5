"""The paged decode attention kernel alone (:func:`raypp.kernels.attention.paged_decode`)
at the benchmark's shape and batch sizes: over its number of context splits, and over
its launch settings against the device's tuning table (:mod:`raypp.kernels.tuning`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.cuda_timing import graph_seconds
from benchmarks.gpu.decode_workload import BATCHES, MAX_MODEL_LEN, PROMPT_LEN
from benchmarks.harness import log

SPLITS = (1, 2, 4, 8, 16)


def attention_splits(bw: float) -> dict[str, Any]:
    """The paged decode kernel at the 1B shape (32 heads, 8 kv heads, dim 64, context
    ``PROMPT_LEN + 64``, tables as wide as ``MAX_MODEL_LEN``) over its split counts;
    ``default`` is what ``num_splits`` picks. Time per call: 16 calls (one per layer,
    each over its own cache) replayed as one CUDA graph, so launches cost what they
    cost in a decode replay. ``bw``: copy GB/s, for ``ideal_us``."""
    return _per_batch("attention", lambda kb: _split_sweep(kb, bw))


def attention_launch(bw: float) -> dict[str, Any]:
    """The decode kernel's launch settings (tokens per iteration, warps, pipeline
    stages) at the default split count and at the split sweep's best, timed as in
    :func:`attention_splits`; the five fastest and the default (the device's
    ``decode_launch`` in :mod:`raypp.kernels.tuning`) per batch."""
    return _per_batch("attention launch", lambda kb: _launch_sweep(kb, bw))


def _per_batch(name: str, fn: Callable[[KernelBench], dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in BATCHES:
        out[f"b{batch}"] = fn(KernelBench(batch))
        log(f"{name} b={batch}: {out[f'b{batch}']}")
        torch.cuda.empty_cache()
    return out


class KernelBench:
    """16 layers' caches and one decode batch at the benchmark's shape, on ``cuda``."""

    LAYERS = 16

    def __init__(self, batch: int):
        from raypp.kernels import attention, tuning

        self.attention = attention
        ctx, block = PROMPT_LEN + 64, 16
        width = MAX_MODEL_LEN // block
        self.caches = [torch.randn(2, batch * width, block, 8, 64, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(self.LAYERS)]
        self.tables = torch.arange(batch * width, device="cuda").view(batch, width)
        self.lens = torch.full((batch,), ctx, device="cuda")
        self.q = torch.randn(batch, 32, 64, device="cuda", dtype=torch.bfloat16)
        self.kv_bytes = batch * ctx * 8 * 64 * 2 * 2
        self.default_splits = attention.num_splits(batch, 8, width * block, self.q.device)
        self.default_launch = tuning.tables(self.q.device).decode_launch  # paged_decode's own

    def seconds(self, splits: int, launch: Any = None) -> float:
        """Time of one layer's call, from a CUDA graph of all 16 layers."""
        launch = launch or self.default_launch

        def run() -> None:
            for c in self.caches:
                self.attention.paged_decode(self.q, c[0], c[1], self.tables, self.lens, 0.125,
                                            splits=splits, launch=launch)

        return graph_seconds(run, 1) / self.LAYERS


def _split_sweep(kb: KernelBench, bw: float) -> dict[str, Any]:
    res: dict[str, Any] = {"default": kb.default_splits}
    for splits in SPLITS:
        t = kb.seconds(splits)
        res[f"s{splits}_us"] = round(1e6 * t, 2)
        res[f"s{splits}_TBps"] = round(kb.kv_bytes / t / 1e12, 2)
    res["ideal_us"] = round(1e6 * kb.kv_bytes / (bw * 1e9), 2)
    return res


def _launch_sweep(kb: KernelBench, bw: float) -> dict[str, Any]:
    from raypp.kernels.tuning import DecodeLaunch

    best_split = min(SPLITS, key=kb.seconds)
    times = {}
    for splits in sorted({kb.default_splits, best_split}):
        for block in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    launch = DecodeLaunch(block, warps, stages)
                    times[(splits, launch)] = kb.seconds(splits, launch)
    default = times[(kb.default_splits, kb.default_launch)]

    def row(key: tuple[int, Any]) -> dict[str, Any]:
        splits, launch = key
        return {"splits": splits, **launch._asdict(), "us": round(1e6 * times[key], 2),
                "TBps": round(kb.kv_bytes / times[key] / 1e12, 2)}

    return {"default": row((kb.default_splits, kb.default_launch)),
            "best_split": best_split,
            "fastest": [row(k) for k in sorted(times, key=times.get)[:5]],
            "default_over_fastest": round(default / min(times.values()), 3),
            "ideal_us": round(1e6 * kb.kv_bytes / (bw * 1e9), 2),
            "all_us": {f"s{s}_b{la.block}_w{la.num_warps}_st{la.num_stages}": round(1e6 * t, 2)
                       for (s, la), t in times.items()}}
