"""Batch-1 projections: raypp's Triton GEMV (with and without programmatic dependent
launch) against cuBLAS, per shape and as the 16-layer chain of a decode step.

    python -m benchmarks.kernels.gemv_probe --out DIR

(from the repository root; formerly ``python -m raypp.bench.gemv_probe``).

Per shape of the Llama-3.2-1B layer (qkv, o, gate/up with SiLU·mul, down): every
GEMV setting in ``CONFIGS`` without PDL, the four fastest again with PDL, and
``F.linear`` (plus ``F.silu(gate) * up``), each as 24 launches over different weights
in one CUDA graph. Then the layer chain without attention (norm, qkv, o, norm,
gate/up, down; 16 layers, 1.95 GB of weights) with cuBLAS, with the GEMV at
:func:`raypp.kernels.tuning.gemv_config`'s settings (the running GPU's table), and with
the per-shape best. Results: benchmarks/gpu/README.md (run 7).
:mod:`benchmarks.kernels.gemm_probe` runs the same sweep (:func:`sweep_shape`) and chain
(:func:`layer_chain`) with the decode-batch GEMM.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import bandwidth, graph_seconds
from benchmarks.harness import add_run_args, log
from raypp.kernels.linear import gemv
from raypp.kernels.norm import rms_norm

HIDDEN, INTER, QKV, LAYERS = 2048, 8192, 3072, 16
SHAPES = {"qkv": (QKV, HIDDEN, False), "o": (HIDDEN, HIDDEN, False),
          "gate_up": (INTER, HIDDEN, True), "down": (HIDDEN, INTER, False)}
CONFIGS = [(bn, bk, warps) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048)
           for warps in (4, 8)]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ``project(x, w, bias, gated, pdl, config)``: raypp's GEMV or GEMM
Project = Callable[..., torch.Tensor]


def sweep_shape(project: Project, m: int, n: int, k: int, gated: bool, bw_gbps: float,
                candidates: list[tuple[int, ...]], deadline: float = math.inf,
                top: int = 4) -> dict[str, Any]:
    """One projection shape at ``m`` rows: cuBLAS (plus ``F.silu(gate) * up``), then the
    ``candidates`` without PDL in order until ``deadline`` (``time.monotonic()``), the
    ``top`` fastest again with PDL; each as 24 launches over different weights (600 MB of
    copies, more than L2 holds) in one CUDA graph. The first candidate's time is
    ``default_us``."""
    rows = 2 * n if gated else n
    copies = max(2, -(-(600 << 20) // (2 * rows * k)))  # more than fits in L2
    ws = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), ws[0].double())
    if gated:
        ref = F.silu(ref[:, :n]) * ref[:, n:]
    turn = count()

    def cublas() -> torch.Tensor:
        y = F.linear(x, ws[next(turn) % len(ws)])
        return F.silu(y[:, :n]) * y[:, n:] if gated else y

    r: dict[str, Any] = {"bytes": 2 * rows * k,
                         "ideal_us": round(2 * rows * k / bw_gbps / 1e3, 2),
                         "cublas_us": round(1e6 * graph_seconds(cublas, 24), 2)}
    plain: dict[tuple[int, ...], float] = {}
    for pdl in (False, True):
        configs = sorted(plain, key=plain.get)[:top] if pdl else candidates
        best = None
        for cfg in configs:
            if not pdl and plain and time.monotonic() > deadline:
                r["swept"] = len(plain)
                break
            try:
                err = _rel_err(project(x, ws[0], None, gated, pdl, cfg), ref)
            except Exception as e:  # noqa: BLE001 - a setting Triton cannot compile
                r[f"{cfg} pdl={pdl}"] = f"failed: {type(e).__name__}"
                continue
            if err > 1e-2:
                r[f"{cfg} pdl={pdl}"] = f"wrong: rel err {err:.3g}"
                continue
            t = graph_seconds(lambda cfg=cfg, pdl=pdl:
                               project(x, ws[next(turn) % len(ws)], None, gated, pdl, cfg), 24)
            if not pdl:
                plain[cfg] = t
                if cfg == candidates[0]:
                    r["default_us"] = round(1e6 * t, 2)
            if best is None or t < best[0]:
                best = (t, cfg)
        if best:
            r["pdl" if pdl else "plain"] = {
                "us": round(1e6 * best[0], 2), "config": best[1],
                "TBps": round(2 * rows * k / best[0] / 1e12, 2)}
    r["top_plain"] = [(c, round(1e6 * t, 2))
                      for c, t in sorted(plain.items(), key=lambda kv: kv[1])[:8]]
    return r


def shape_sweep(bw_gbps: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (n, k, gated) in SHAPES.items():
        candidates = [c for c in CONFIGS
                      if c[1] <= k and c[0] * c[1] <= (8192 if gated else 16384)]
        res[name] = sweep_shape(gemv, 1, n, k, gated, bw_gbps, candidates)
        torch.cuda.empty_cache()  # this shape's weight copies
        log(f"gemv {name}: {res[name]}")
    return res


def layer_chain(project: Project, m: int, shapes: dict[str, Any], bw_gbps: float
                ) -> dict[str, Any]:
    """16 layers at ``m`` rows without attention: norm → qkv → o(q) → norm → gate_up →
    down, with cuBLAS and with ``project`` at its default settings (without and with PDL)
    and at each shape's best with PDL from ``shapes``."""
    dev, dt = "cuda", torch.bfloat16
    layers = [{"qkv": torch.randn(QKV, HIDDEN, device=dev, dtype=dt) * 0.02,
               "o": torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * 0.02,
               "gate_up": torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt) * 0.02,
               "down": torch.randn(HIDDEN, INTER, device=dev, dtype=dt) * 0.02,
               "norm": torch.ones(HIDDEN, device=dev, dtype=dt)} for _ in range(LAYERS)]
    h0 = torch.randn(m, HIDDEN, device=dev, dtype=dt)
    weight_bytes = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())

    def run(kind: str, pdl: bool = False, configs: dict | None = None) -> torch.Tensor:
        h, res = h0, None
        configs = configs or {}
        for w in layers:
            x, res = rms_norm(h, res, w["norm"], 1e-5, pdl)
            if kind == "cublas":
                o = F.linear(F.linear(x, w["qkv"])[:, :HIDDEN], w["o"])
            else:
                qkv = project(x, w["qkv"], None, False, pdl, configs.get("qkv"))
                o = project(qkv[:, :HIDDEN], w["o"], None, False, pdl, configs.get("o"))
            x, res = rms_norm(o, res, w["norm"], 1e-5, pdl)
            if kind == "cublas":
                gu = F.linear(x, w["gate_up"])
                h = F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], w["down"])
            else:
                h = project(project(x, w["gate_up"], None, True, pdl, configs.get("gate_up")),
                            w["down"], None, False, pdl, configs.get("down"))
        return h

    out: dict[str, Any] = {"rows": m, "weight_bytes": weight_bytes,
                           "ideal_us": round(weight_bytes / bw_gbps / 1e3, 1),
                           "cublas_us": round(1e6 * graph_seconds(lambda: run("cublas"), 1), 1)}
    best = {k: tuple(v["pdl"]["config"]) for k, v in shapes.items() if "pdl" in v}
    for tag, pdl, configs in (("triton_default", False, None), ("triton_default_pdl", True, None),
                              ("triton_best_pdl", True, best)):
        out[f"{tag}_us"] = round(1e6 * graph_seconds(lambda p=pdl, c=configs: run("t", p, c), 1),
                                 1)
    log(f"layer chain m={m}: {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_probe",
                                 description=__doc__.split("\n")[0])
    add_run_args(ap, out_default="bench_out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = bandwidth()["copy_GBps"]
    res: dict[str, Any] = {"copy_GBps": round(bw, 1), "shapes": shape_sweep(bw)}
    res["layer_chain"] = layer_chain(gemv, 1, res["shapes"], bw)
    (out / "gemv_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
