"""FP8 against bf16 on the GPU (NOT YET RUN: written in a session without a GPU; the next
GPU session runs it, see benchmarks/gpu/README.md, "FP8: not yet run").

``python -m benchmarks.gpu.fp8_decode --out DIR [--sections gemm,llama8b,qwen3_8b,kv]
[--budget-s 570] [--ckpt-root /tmp/raypp_fp8]``

Sections (each records into ``DIR/results.json``; ``DIR/summary.txt`` holds the table):

- ``gemm``: each projection of Llama-3.1-8B and Qwen3-8B at 1, 16, 64, 256 and 1024 rows:
  bf16 ``F.linear`` (cuBLAS), the Triton GEMM reading e4m3 weights with one scale per row
  and with 128-column block scales, and ``torch._scaled_mm`` with row-wise scales (Hopper),
  in µs (``triton.testing.do_bench``, median) and the weight bytes read per second;
- ``llama8b`` / ``qwen3_8b``: the engine (defaults, ``gpu_memory_utilization`` 0.85,
  ``max_model_len`` 1024) on random weights of that shape in bf16, FP8 per channel
  (``quantization="fp8"`` of the bf16 checkpoint) and block FP8 (a 128×128
  ``weight_scale_inv`` checkpoint): decode tokens/s at batch 1 and 64 (512-token random
  prompts, 256 greedy tokens, ``ignore_eos``; from the step after every sequence has its
  first token, as ``rounds_ab.py`` measures), and end to end on 64 prompts of 512 + 256
  tokens (wall time, output tokens/s);
- ``kv``: KV blocks of the Llama-8B bf16 engine with ``kv_cache_dtype`` auto and fp8 at the
  same ``gpu_memory_utilization``.

Targets (issue 34): batch 1 ≥ 1.7× bf16 (≥ 85 % of the FP8 weight-read roofline: FP8
linear bytes + bf16 embedding/LM head over the card's measured read bandwidth), batch 64
≥ 1.5× bf16, FP8 KV 2× the blocks. One section may not fit one device call (an 8B engine
starts in minutes); run them in separate calls with ``--sections``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.fp8_checkpoints import MODELS, bf16_checkpoint, block_fp8_checkpoint
from benchmarks.gpu.rounds_ab import _decode_run
from benchmarks.harness import Run, add_run_args, log, machine_info, parse_sections

ROWS = (1, 16, 64, 256, 1024)
PROMPT_LEN, OUTPUT_LEN = 512, 256
VARIANTS = {"bf16": {}, "fp8_channel": {"quantization": "fp8"}, "fp8_block": {}}


def _shapes(model: str) -> dict[str, tuple[int, int]]:
    s = MODELS[model][2]
    kv = s["num_key_value_heads"] * s["head_dim"]
    q = s["num_attention_heads"] * s["head_dim"]
    return {"qkv": (q + 2 * kv, s["hidden_size"]), "o": (s["hidden_size"], q),
            "gate_up": (2 * s["intermediate_size"], s["hidden_size"]),
            "down": (s["hidden_size"], s["intermediate_size"])}


def _candidates(w: torch.Tensor) -> dict[str, Any]:
    """Name → ``f(x)`` for each GEMM of ``x @ w.T`` being compared (FP8 ones on ``w``
    quantized by their rule)."""
    from raypp.kernels.fp8_linear import fp8_gemm
    from raypp.model.quantization import fp8
    from raypp.model.quantization.linear import rowwise_scaled_mm_supported, scaled_mm_rowwise

    w16 = w.bfloat16()
    q_row, s_row = fp8.quantize_rows(w, None)
    q_blk, s_blk = fp8.quantize_rows(w, 128)
    out = {"bf16": lambda x: torch.nn.functional.linear(x, w16),
           "fp8_row_triton": lambda x: fp8_gemm(x, q_row, s_row, None, 0),
           "fp8_block_triton": lambda x: fp8_gemm(x, q_blk, s_blk, None, 128)}
    if rowwise_scaled_mm_supported(w.device):
        out["fp8_row_scaled_mm"] = lambda x: scaled_mm_rowwise(x, q_row, s_row, None)
    return out


def gemm_section() -> dict[str, Any]:
    from triton.testing import do_bench

    out: dict[str, Any] = {}
    for model in MODELS:
        for proj, (n, k) in _shapes(model).items():
            w = torch.randn(n, k, device="cuda") / k**0.5
            ref_w = w.bfloat16().float()
            gemms = _candidates(w)
            del w
            for m in ROWS:
                x = torch.randn(m, k, device="cuda").bfloat16()
                ref = x.float() @ ref_w.T
                entry: dict[str, Any] = {}
                for key, f in gemms.items():
                    ms = do_bench(lambda f=f, x=x: f(x))
                    entry[f"{key}_us"] = round(1000 * ms, 2)
                    entry[f"{key}_weight_GBps"] = round(
                        n * k * (2 if key == "bf16" else 1) / (ms * 1e-3) / 1e9, 1)
                    entry[f"{key}_rel_err"] = float((f(x).float() - ref).norm() / ref.norm())
                out[f"{model}/{proj}/m{m}"] = entry
                log(f"{model} {proj} m={m}: " + ", ".join(
                    f"{k} {v}" for k, v in entry.items() if k.endswith("_us")))
    return out


def _engine(ckpt: Path, **options: Any) -> Any:
    from raypp import LLM

    return LLM(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=1024,
               gpu_memory_utilization=0.85, **options)


def engine_section(model: str, root: Path, run: Run) -> dict[str, Any]:
    from benchmarks.gpu.decode_workload import random_prompts
    from raypp import SamplingParams

    bf16 = bf16_checkpoint(root / f"{model}_bf16", model)
    ckpts = {"bf16": bf16, "fp8_channel": bf16,
             "fp8_block": block_fp8_checkpoint(bf16, root / f"{model}_fp8_block")}
    vocab = MODELS[model][2]["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    out: dict[str, Any] = {}
    for variant, options in VARIANTS.items():
        if run.left() < 120:
            out[variant] = "skipped: out of time"
            continue
        started = time.perf_counter()
        llm = _engine(ckpts[variant], **options)
        res: dict[str, Any] = {"startup_s": round(time.perf_counter() - started, 1),
                               "stages": llm.engine.executor.pool.stage_summary}
        try:
            llm.generate([[5] * 32], SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)  # warm
            for batch in (1, 64):
                prompts = [[t % vocab for t in p] for p in random_prompts(batch, PROMPT_LEN, batch)]
                res[f"decode_b{batch}"] = _decode_run(llm.engine, prompts, params,
                                                      f"{variant}-b{batch}")
            prompts = [[t % vocab for t in p] for p in random_prompts(64, PROMPT_LEN, 7)]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            wall = time.perf_counter() - t0
            res["e2e_64x512+256"] = {"wall_s": round(wall, 2), "output_tok_s": round(
                sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1)}
        finally:
            llm.shutdown()
        out[variant] = res
        log(f"{model} {variant}: {res}")
        run.save()
    return out


def kv_section(root: Path) -> dict[str, Any]:
    bf16 = bf16_checkpoint(root / "llama8b_bf16", "llama8b")
    out = {}
    for kv in ("auto", "fp8"):
        llm = _engine(bf16, kv_cache_dtype=kv, enforce_eager=True)
        try:
            out[kv] = llm.engine.executor.num_kv_blocks
        finally:
            llm.shutdown()
    out["ratio"] = round(out["fp8"] / out["auto"], 3)
    return out


def summary(results: dict[str, Any]) -> str:
    lines = ["FP8 vs bf16 (decode tok/s; speed-up over bf16)"]
    for model in MODELS:
        runs = results.get(model) or {}
        base = runs.get("bf16") if isinstance(runs.get("bf16"), dict) else None
        for variant, res in runs.items():
            if not isinstance(res, dict):
                lines.append(f"{model:9} {variant:12} {res}")
                continue
            cells = []
            for key in ("decode_b1", "decode_b64"):
                tok = res.get(key, {}).get("decode_tok_s")
                ref = (base or {}).get(key, {}).get("decode_tok_s")
                cells.append(f"{key} {tok} ({tok / ref:.2f}x)" if tok and ref else f"{key} {tok}")
            e2e = res.get("e2e_64x512+256", {}).get("output_tok_s")
            lines.append(f"{model:9} {variant:12} " + ", ".join(cells) + f", e2e {e2e} tok/s")
    if "kv" in results:
        lines.append(f"KV blocks at gpu_memory_utilization 0.85: {results['kv']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser, out_default=None, budget_s=570, sections=True)
    parser.add_argument("--ckpt-root", default="/tmp/raypp_fp8")
    args = parser.parse_args(argv)
    only = parse_sections(args.sections)
    run = Run(Path(args.out), args.budget_s, select=lambda s: only is None or s in only,
              summaries={"summary.txt": summary})
    run.results["machine"] = machine_info("cuda")
    root = Path(args.ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    run.results["gemm"] = run.section("gemm", gemm_section, need_s=60)
    for model in MODELS:
        run.results[model] = run.section(model, lambda m=model: engine_section(m, root, run),
                                         need_s=240)
    run.results["kv"] = run.section("kv", lambda: kv_section(root), need_s=120)
    run.save()


if __name__ == "__main__":
    main()
