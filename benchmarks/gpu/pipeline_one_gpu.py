"""Pipeline parallelism with both stages on one GPU: decode tokens/s at pp=2 with one and
two micro-batches in flight beside the pp=1 engine, and the host-staged hop's time.

    python -m benchmarks.gpu.pipeline_one_gpu --out DIR [--budget-s 300] [--ckpt DIR]

Same model and workload as :mod:`benchmarks.gpu.decode` (Llama-3.2-1B's shape, random
bf16 weights, prompts of 512 tokens, 256 greedy output tokens). The two stage workers
share the GPU (``workers_per_gpu=2``), so this shows what the pipeline costs there —
the hop through host memory and two processes time-slicing one GPU — not a speed-up.
The hop's time comes from the stages' own send/recv intervals (``trace_comm``): per
decode step, the first stage's send (device → shared memory) and the second stage's
receive (waiting included, shared memory → device).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.decode_engine import engine_run
from benchmarks.gpu.decode_workload import MAX_MODEL_LEN, OUTPUT_LEN, PROMPT_LEN, make_checkpoint
from benchmarks.gpu.decode_workload import random_prompts as prompts_of
from benchmarks.harness import Run, add_run_args, cuda_card, log, software_versions

BATCHES = (1, 64)


def _llm(ckpt: Path, pp: int, max_inflight: int) -> Any:
    from raypp import LLM

    return LLM(str(ckpt), device="cuda", dtype="bfloat16", pipeline_parallel_size=pp,
               workers_per_gpu=pp, max_inflight=max_inflight, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
               gpu_memory_utilization=0.5, trace_comm=True)


def _drain(llm: Any) -> list[list[tuple]]:
    import ray

    return ray.get([lane[0].drain_comm_trace.remote() for lane in llm.engine.executor.workers],
                   timeout=60)


def _hop(events: list[list[tuple]], steps: int) -> dict[str, Any]:
    """Per decode step: stage 0's send and stage 1's receive, from their traced intervals."""
    sends = [end - start for op, _, start, end, _ in events[0] if op == "send"]
    recvs = [end - start for op, _, start, end, _ in events[1] if op == "recv"]
    nbytes = [n for op, _, _, _, n in events[0] if op == "send"]
    if not sends:
        return {}
    return {"messages": len(sends), "steps": steps,
            "bytes_per_message_median": int(statistics.median(nbytes)),
            "send_ms_median": round(1e3 * statistics.median(sends), 3),
            "recv_ms_median": round(1e3 * statistics.median(recvs), 3) if recvs else None,
            "send_ms_per_step": round(1e3 * sum(sends) / max(1, steps), 3)}


def measure(ckpt: Path, pp: int, inflight: tuple[int, ...], run: Run) -> dict[str, Any]:
    """Decode tok/s at each batch and micro-batches in flight, with the hop's time."""
    from raypp import SamplingParams

    llm = _llm(ckpt, pp, max(inflight))
    out: dict[str, Any] = {}
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate(prompts_of(2, 64, 1), SamplingParams(max_tokens=8), use_tqdm=False)
        for m in inflight:
            engine.config.scheduler.max_inflight = m  # the scheduler reads it every step
            for batch in BATCHES:
                if run.left() < 20:
                    out[f"b{batch}_inflight{m}"] = "skipped: time"
                    continue
                if pp > 1:
                    _drain(llm)
                key = f"b{batch}_inflight{m}"
                result = engine_run(engine, prompts_of(batch, PROMPT_LEN, 100 + batch), params,
                                     f"pp{pp}{key}")
                if pp > 1:  # prefill and decode hops together; decode steps dominate
                    result["hop"] = _hop(_drain(llm), result["decode_steps"])
                out[key] = result
                log(f"pp={pp} {key}: {result}")
        out["transports"] = llm.engine.executor.comm_stats()[0]["transports"]
    finally:
        llm.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.pipeline_one_gpu",
                                 description=__doc__.split("\n")[0])
    add_run_args(ap, out_default=os.environ.get("OUT", "bench_out"), budget_s=300.0,
                 sections=False)
    ap.add_argument("--ckpt", default="/tmp/raypp-llama-1b-random")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    run = Run(Path(args.out), args.budget_s, cleanup=torch.cuda.empty_cache)
    r = run.results
    r["env"] = {**cuda_card(), **software_versions(),
                "workload": f"Llama-3.2-1B shape, bf16, prompt {PROMPT_LEN}, output {OUTPUT_LEN}"}
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        r["checkpoint"] = run.section("checkpoint", lambda: make_checkpoint(ckpt))
    r["pp1"] = run.section("pp1", lambda: measure(ckpt, 1, (1,), run), 60)
    r["pp2"] = run.section("pp2", lambda: measure(ckpt, 2, (1, 2), run), 90)
    run.save()


if __name__ == "__main__":
    main()
