"""Time to first token of 16k- and 32k-token prompts on one GPU: pp=1, and pp=2 (both
stages on the one GPU, ``workers_per_gpu=2``) with chunked pipeline prefill on and off.

``python -m benchmarks.gpu.pipelined_prefill --out DIR [--lens 16384,32768] [--reps 2]
[--budget-s 300]``

A random-weight bf16 Llama of Llama-3.2-1B's shape with 32,768 + 64 positions; defaults
otherwise (CUDA: a step budget of 8,192 tokens, so a 32k prompt is 4 chunks off and 8 or
more on), prefix caching off, one fresh random prompt per measurement generating one
token (TTFT read through ``LLMEngine.step``, as ``benchmarks/pipelined_prefill.py``
does on CPU). Engines run one after another (pp=2 off, pp=2 on, pp=1), each after a
warm-up prompt of the longest length. On one GPU the two stages share its SMs, so
overlapping them gains only what one stage alone leaves idle; the multi-GPU figure
waits for a multi-GPU machine. Results: ``DIR/pipelined_prefill_gpu.json`` and a table.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.pipelined_prefill import _ttft

CONFIGS = [("pp2-off", 2, {"pipelined_prefill": False}), ("pp2-on", 2, {"pipelined_prefill": True}),
           ("pp1", 1, {})]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lens", default="16384,32768")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--ckpt", default="/tmp/raypp_pp_prefill_1b")
    args = parser.parse_args(argv)
    from benchmarks.checkpoints import hf_init_checkpoint
    from benchmarks.gpu.decode_workload import SHAPE_1B
    from raypp import LLM

    lens = [int(n) for n in args.lens.split(",")]
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        hf_init_checkpoint(ckpt, {**SHAPE_1B, "max_position_embeddings": max(lens) + 64})
    deadline = time.monotonic() + args.budget_s
    rng = random.Random(0)
    results: dict[str, Any] = {}
    for name, pp, kwargs in CONFIGS:
        if time.monotonic() > deadline:
            break
        llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", pipeline_parallel_size=pp,
                  workers_per_gpu=pp, gpu_memory_utilization=0.6, enable_prefix_caching=False,
                  max_model_len=max(lens) + 64, **kwargs)
        try:
            prompt = lambda n: [rng.randrange(3, SHAPE_1B["vocab_size"]) for _ in range(n)]  # noqa: E731
            _ttft(llm, prompt(max(lens)))  # warm-up
            row: dict[str, Any] = {}
            for n in lens:
                runs = [_ttft(llm, prompt(n)) for _ in range(args.reps)]
                row[str(n)] = {"ttft_s": [round(s, 4) for s, _ in runs], "steps": runs[-1][1]}
            row["overlapped_chunks"] = llm.engine.scheduler.num_overlapped_chunks
            results[name] = row
        finally:
            llm.shutdown()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipelined_prefill_gpu.json").write_text(json.dumps(results, indent=1))
    print("| config | " + " | ".join(f"TTFT {n} (s)" for n in lens) + " |")
    print("|---|" + "---|" * len(lens))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(
            f"{min(row[str(n)]['ttft_s']):.3f} ({row[str(n)]['steps']} steps)" for n in lens) + " |")


if __name__ == "__main__":
    main()
