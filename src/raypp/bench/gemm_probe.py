"""Decode-batch projections: raypp's split-K Triton GEMM (with and without programmatic
dependent launch) against cuBLAS, per shape and as the 16-layer chain of a decode step.

    python -m raypp.bench.gemm_probe --out DIR [--rows 64,16] [--budget-s 240]

Per shape of the Llama-3.2-1B layer (qkv, o, gate/up with SiLU·mul, down) and batch
(``--rows``): ``F.linear`` (plus ``F.silu(gate) * up``), then GEMM settings without PDL
(:func:`raypp.model.triton_decode.gemm_config`'s first, then a grid of tile sizes, K
splits, warps and pipeline stages until the time budget is spent), the five fastest again with PDL; each as 24
launches over different weights in one CUDA graph. Then the layer chain without
attention (norm, qkv, o, norm, gate/up, down; 16 layers, 1.95 GB of weights) with
cuBLAS, with the GEMM at ``gemm_config``'s settings and at each shape's best. Results:
benchmarks/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from raypp.bench.gemv_probe import HIDDEN, INTER, LAYERS, QKV, SHAPES, _graph_seconds, _rel_err
from raypp.bench.gpu_decode import bandwidth, log
from raypp.model.triton_decode import GemmConfig, gemm, gemm_config, rms_norm

GRID = [(bn, bk, split, warps, stages) for bn in (32, 64, 128) for bk in (64, 128, 256)
        for split in (1, 2, 4, 8) for stages in (1, 3, 4) for warps in (4, 8)]


def _candidates(m: int, n: int, k: int, gated: bool, seeds: list[list[int]]
                ) -> list[GemmConfig]:
    """``gemm_config``'s choice first; then each of ``seeds`` (tile and split settings,
    e.g. an earlier sweep's fastest) with every warp count and stage count; then the
    grid's settings with 8-32 KB weight tiles and 128..1024 programs, closest to 16 KB
    and 256 programs first."""
    first = gemm_config(m, n, k, gated, torch.bfloat16)
    seeded = [(*seed[:3], warps, stages) for seed in seeds for stages in (1, 3, 4)
              for warps in (4, 8)]
    out = [(-1, cfg) for cfg in seeded]
    for cfg in GRID:
        bn, bk, split, _, _ = cfg
        tile = bn * bk * 2 * (2 if gated else 1)
        programs = -(-n // bn) * split
        if 8192 <= tile <= 32768 and 128 <= programs <= 1024 and k // split >= bk:
            out.append((abs(tile.bit_length() - 15) + abs(programs.bit_length() - 9), cfg))
    ordered = [first] + [c for _, c in sorted(out, key=lambda dc: dc[0]) if c != first]
    return list(dict.fromkeys(ordered))


def shape_sweep(m: int, bw_gbps: float, deadline: float, seeds: dict[str, Any]
                ) -> dict[str, Any]:
    res: dict[str, Any] = {}
    per_shape = (deadline - time.monotonic()) / len(SHAPES)
    for name, (n, k, gated) in SHAPES.items():
        stop = time.monotonic() + per_shape
        rows = 2 * n if gated else n
        copies = max(2, -(-(600 << 20) // (2 * rows * k)))  # more than fits in L2
        ws = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.double(), ws[0].double())
        if gated:
            ref = F.silu(ref[:, :n]) * ref[:, n:]
        turn = count()

        def cublas(ws=ws, x=x, turn=turn, gated=gated, n=n) -> torch.Tensor:
            y = F.linear(x, ws[next(turn) % len(ws)])
            return F.silu(y[:, :n]) * y[:, n:] if gated else y

        r: dict[str, Any] = {"bytes": 2 * rows * k,
                             "ideal_us": round(2 * rows * k / bw_gbps / 1e3, 2),
                             "cublas_us": round(1e6 * _graph_seconds(cublas, 24), 2)}
        plain: dict[GemmConfig, float] = {}
        for pdl in (False, True):
            configs = (sorted(plain, key=plain.get)[:5] if pdl
                       else _candidates(m, n, k, gated, [
                           c for c, _ in seeds.get(name, {}).get("top_plain", [])[:4]]))
            best = None
            for cfg in configs:
                if not pdl and plain and time.monotonic() > stop:
                    r["swept"] = len(plain)
                    break
                try:
                    err = _rel_err(gemm(x, ws[0], None, gated, pdl, cfg), ref)
                except Exception as e:  # noqa: BLE001 - a setting Triton cannot compile
                    r[f"{cfg} pdl={pdl}"] = f"failed: {type(e).__name__}"
                    continue
                if err > 1e-2:
                    r[f"{cfg} pdl={pdl}"] = f"wrong: rel err {err:.3g}"
                    continue
                t = _graph_seconds(lambda cfg=cfg, pdl=pdl, ws=ws, x=x, turn=turn, gated=gated:
                                   gemm(x, ws[next(turn) % len(ws)], None, gated, pdl, cfg), 24)
                if not pdl:
                    plain[cfg] = t
                if cfg == configs[0] and not pdl:
                    r["default_us"] = round(1e6 * t, 2)
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best:
                r["pdl" if pdl else "plain"] = {
                    "us": round(1e6 * best[0], 2), "config": best[1],
                    "TBps": round(2 * rows * k / best[0] / 1e12, 2)}
        r["top_plain"] = [(c, round(1e6 * t, 2)) for c, t in
                          sorted(plain.items(), key=lambda kv: kv[1])[:8]]
        res[name] = r
        log(f"gemm m={m} {name}: {r}")
        del ws
        torch.cuda.empty_cache()
    return res


def layer_chain(m: int, shapes: dict[str, Any], bw_gbps: float) -> dict[str, Any]:
    """16 layers at ``m`` rows without attention: norm → qkv → o(q) → norm → gate_up → down."""
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
                o = F.linear(F.linear(x, w["qkv"])[:, :HIDDEN].contiguous(), w["o"])
            else:
                qkv = gemm(x, w["qkv"], None, False, pdl, configs.get("qkv"))
                o = gemm(qkv[:, :HIDDEN], w["o"], None, False, pdl, configs.get("o"))
            x, res = rms_norm(o, res, w["norm"], 1e-5, pdl)
            if kind == "cublas":
                gu = F.linear(x, w["gate_up"])
                h = F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], w["down"])
            else:
                h = gemm(gemm(x, w["gate_up"], None, True, pdl, configs.get("gate_up")),
                         w["down"], None, False, pdl, configs.get("down"))
        return h

    out: dict[str, Any] = {"rows": m, "weight_bytes": weight_bytes,
                           "ideal_us": round(weight_bytes / bw_gbps / 1e3, 1),
                           "cublas_us": round(1e6 * _graph_seconds(lambda: run("cublas"), 1), 1)}
    best = {k: tuple(v["pdl"]["config"]) for k, v in shapes.items() if "pdl" in v}
    for tag, pdl, configs in (("triton_default", False, None), ("triton_default_pdl", True, None),
                              ("triton_best_pdl", True, best)):
        out[f"{tag}_us"] = round(1e6 * _graph_seconds(lambda p=pdl, c=configs: run("t", p, c), 1),
                                 1)
    log(f"layer chain m={m}: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rows", default="64,16")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--seeds", help="an earlier gemm_probe.json: its fastest settings per "
                    "shape and batch are tried first, with every warp and stage count")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    bw = bandwidth()["copy_GBps"]
    res: dict[str, Any] = {"copy_GBps": round(bw, 1)}
    rows = [int(r) for r in args.rows.split(",")]
    for i, m in enumerate(rows):
        left = args.budget_s - (time.monotonic() - started)
        deadline = time.monotonic() + 0.8 * left / (len(rows) - i)
        seeds = json.loads(Path(args.seeds).read_text()) if args.seeds else {}
        nearest = min((int(key[1:]) for key in seeds if key.startswith("m")),
                      key=lambda r: abs(r - m), default=None)
        shapes = shape_sweep(m, bw, deadline,
                             seeds[f"m{nearest}"]["shapes"] if nearest else {})
        res[f"m{m}"] = {"shapes": shapes, "layer_chain": layer_chain(m, shapes, bw)}
        (out / "gemm_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
