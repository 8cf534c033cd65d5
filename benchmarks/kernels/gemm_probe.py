"""Decode-batch projections: raypp's split-K Triton GEMM (with and without programmatic
dependent launch) against cuBLAS, per shape and as the 16-layer chain of a decode step.

    python -m benchmarks.kernels.gemm_probe --out DIR [--rows 64,16] [--budget-s 240] [--seeds JSON]

(from the repository root; formerly ``python -m raypp.bench.gemm_probe``).

Per shape of the Llama-3.2-1B layer (qkv, o, gate/up with SiLU·mul, down) and batch
(``--rows``): ``F.linear`` (plus ``F.silu(gate) * up``), then GEMM settings without PDL
(:func:`raypp.kernels.tuning.gemm_config`'s for the running GPU first, then a grid of
tile sizes, K splits, warps and pipeline stages until the time budget is spent), the
five fastest again with PDL; each as 24 launches over different weights in one CUDA
graph. Then the layer chain without attention (norm, qkv, o, norm, gate/up, down; 16
layers, 1.95 GB of weights) with cuBLAS, with the GEMM at ``gemm_config``'s settings
and at each shape's best. Writes ``gemm_probe.json``; results: benchmarks/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cuda_timing import bandwidth
from benchmarks.harness import add_run_args, log
from benchmarks.kernels.gemv_probe import SHAPES, layer_chain, sweep_shape
from raypp.kernels.linear import gemm
from raypp.kernels.tuning import gemm_config

GRID = [(bn, bk, split, warps, stages) for bn in (32, 64, 128) for bk in (64, 128, 256)
        for split in (1, 2, 4, 8) for stages in (1, 3, 4) for warps in (4, 8)]


def _candidates(m: int, n: int, k: int, gated: bool, seeds: list[list[int]]
                ) -> list[tuple[int, ...]]:
    """``gemm_config``'s choice first; then each of ``seeds`` (tile and split settings,
    e.g. an earlier sweep's fastest) with every warp count and stage count; then the
    grid's settings with 8-32 KB weight tiles and 128..1024 programs, closest to 16 KB
    and 256 programs first."""
    # a plain tuple, as the grid's and the seeds' (results.json keys print it)
    first = tuple(gemm_config(torch.device("cuda"), m, n, k, gated, torch.bfloat16))
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
        candidates = _candidates(m, n, k, gated, [
            c for c, _ in seeds.get(name, {}).get("top_plain", [])[:4]])
        res[name] = sweep_shape(gemm, m, n, k, gated, bw_gbps, candidates,
                                time.monotonic() + per_shape, top=5)
        torch.cuda.empty_cache()  # this shape's weight copies
        log(f"gemm m={m} {name}: {res[name]}")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemm_probe",
                                 description=__doc__.split("\n")[0])
    add_run_args(ap, out_default="bench_out", budget_s=240.0,
                 budget_help="seconds for the whole sweep, shared between the row counts")
    ap.add_argument("--rows", default="64,16")
    ap.add_argument("--seeds", help="an earlier gemm_probe.json: its fastest settings per "
                    "shape and batch are tried first, with every warp and stage count")
    args = ap.parse_args(argv)
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
        res[f"m{m}"] = {"shapes": shapes, "layer_chain": layer_chain(gemm, m, shapes, bw)}
        (out / "gemm_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
