"""Is a Triton GEMV faster than cuBLAS for the batch-1 decode projections?

    python -m raypp.bench.gemv_probe --out DIR

``y = x @ w.T`` for ``x`` of 1–8 rows: each program owns ``BLOCK_N`` rows of
``w``, streams them over ``K`` once for all of ``x``'s rows and keeps fp32 sums.
The probe times it against ``F.linear`` on the 1B shape's projections inside
CUDA graphs (as in a decode replay), over every config in ``GEMV_CONFIGS``.
Result (H200, ``benchmarks/gpu/README.md``, run 4): the same as cuBLAS within
±4 % except the o projection (1.3×) and the LM head (1.07×); both are bound by
a fixed ~5 µs per small kernel, not by bandwidth, so raypp keeps cuBLAS.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from raypp.bench.gpu_decode import _time_cuda, bandwidth, log


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask, m_mask = rn < N, rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 8, block_k: int = 512,
         num_warps: int = 4) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[M <= 8, K]`` and ``w`` ``[N, K]``, both contiguous."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= 8 and w.shape[1] == k and x.is_contiguous() and w.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    return y


GEMV_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
               "down": (2048, 8192), "lm_head": (128256, 2048)}
GEMV_CONFIGS = [(bn, bk, nw) for bn in (4, 8, 16) for bk in (256, 512, 1024) for nw in (2, 4, 8)]


def _probe_shape(n: int, k: int, bw: float) -> dict[str, Any]:
    import torch.nn.functional as F

    copies = max(2, -(-(512 << 20) // (2 * n * k)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())

    def graphed(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        fn(ws[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(24):
                fn(ws[i % len(ws)])
        return _time_cuda(graph.replay, 10) / 24

    res: dict[str, Any] = {"bytes": 2 * n * k}
    t = graphed(lambda w: F.linear(x, w))
    res["cublas_us"] = round(1e6 * t, 2)
    res["cublas_TBps"] = round(2 * n * k / t / 1e12, 2)
    best = None
    for bn, bk, nw in GEMV_CONFIGS:
        tag = f"{bn}x{bk}w{nw}"
        try:
            err = _rel_err(gemv(x, ws[0], bn, bk, nw).float(), ref)
            if err > 1e-2:
                res[tag] = f"wrong: rel err {err:.3g}"
                continue
            t = graphed(lambda w, bn=bn, bk=bk, nw=nw: gemv(x, w, bn, bk, nw))
        except Exception as e:  # noqa: BLE001 - a config that does not compile
            res[tag] = type(e).__name__
            continue
        if best is None or t < best[0]:
            best = (t, tag)
    if best:
        res["triton_best_us"] = round(1e6 * best[0], 2)
        res["triton_best_TBps"] = round(2 * n * k / best[0] / 1e12, 2)
        res["triton_best_config"] = best[1]
        res["speedup_vs_cublas"] = round(res["cublas_us"] / res["triton_best_us"], 3)
    res["ideal_us_at_copy_bw"] = round(1e6 * 2 * n * k / (bw * 1e9), 2)
    return res


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = bandwidth()["copy_GBps"]
    res = {}
    for name, (n, k) in GEMV_SHAPES.items():
        res[name] = r = _probe_shape(n, k, bw)
        log(f"gemv {name}: {r.get('cublas_us')} us cuBLAS vs {r.get('triton_best_us')} us "
            f"Triton ({r.get('triton_best_config')})")
        torch.cuda.empty_cache()
    (out / "gemv_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
