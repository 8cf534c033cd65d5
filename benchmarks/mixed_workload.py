"""Output throughput of a mixed workload (many short chats decoding, a few long prompts
arriving among them) with balanced decode micro-batches on and off.

``python -m benchmarks.mixed_workload [--device cpu|cuda] [--model tiny|bench|1b|DIR]
[--pp 2] [--workers-per-gpu N (CUDA; default: pp × 2, both engines on one GPU)]
[--chats 32] [--longs 2] [--long-len 1536] [--reps 2] [--out FILE]``

One engine per mode, both started before measuring and used in turn (``balanced``: the
default, at most ``ceil(decodes / micro-batches in flight)`` decode rows per micro-batch;
``unbalanced``: ``balanced_decode=False``, every ready decode row joins the next
micro-batch), ``--reps`` times, so drift of the machine shows as spread. Each run:
``--chats`` requests of 32-128 random prompt tokens and 64-128 greedy output tokens
(``ignore_eos``) start together; once every chat has its first token, ``--longs`` prompts
of ``--long-len`` tokens arrive one per ``--long-every`` engine steps, each generating 16
tokens. Reported per run: output tokens/s over the run (every request's output tokens,
wall time from the first ``add_request`` to the last token), the chats' inter-token
latency (median and p99, tokens of one step counted at the step's return), the long
prompts' TTFT, and the ``LLMEngine.step`` calls (how many, their median and the five
slowest: one-time costs), all read through ``LLMEngine.step``. Defaults otherwise, prefix
caching off, fp32 on CPU, bf16 on CUDA. Models as in :mod:`benchmarks.pipelined_prefill`, plus
``1b`` (Llama-3.2-1B's shape, random weights; for the GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.pipelined_prefill import _model

MODES = {"balanced": {}, "unbalanced": {"balanced_decode": False}}


def _checkpoint(name: str, max_len: int) -> Path:
    if name != "1b":
        return _model(name)
    from benchmarks.checkpoints import hf_init_checkpoint
    from benchmarks.gpu.decode_workload import SHAPE_1B

    path = Path("/tmp/raypp_mixed_1b")
    if not (path / "config.json").is_file():
        hf_init_checkpoint(path, {**SHAPE_1B, "max_position_embeddings": max_len})
    return path


def run_once(llm: Any, vocab: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One mixed workload on ``llm``'s engine; its throughput and latencies."""
    from raypp import SamplingParams

    engine, rng = llm.engine, random.Random(seed)
    engine.emit_unfinished = True  # every step's new tokens, as a server streams them
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    seen: dict[str, int] = {}
    last_token_at: dict[str, float] = {}
    gaps: list[float] = []
    ttft: dict[str, float] = {}
    added_at: dict[str, float] = {}

    def add(rid: str, n_prompt: int, n_out: int) -> None:
        added_at[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt(n_prompt)},
                           SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))

    started = time.perf_counter()
    for i in range(args.chats):
        add(f"chat{seed}-{i}", rng.randint(32, 128), rng.randint(64, 128))
    longs_added = steps_since = 0
    step_s: list[float] = []
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_s.append(now - before)
        for out in outputs:
            rid, n = out.request_id, len(out.outputs[0].token_ids)
            if n > seen.get(rid, 0):
                if rid not in ttft:
                    ttft[rid] = now - added_at[rid]
                elif rid.startswith("chat"):
                    gaps.append(now - last_token_at[rid])
                seen[rid], last_token_at[rid] = n, now
        chats_started = sum(1 for r in ttft if r.startswith("chat")) == args.chats
        steps_since += 1
        if chats_started and longs_added < args.longs and steps_since >= args.long_every:
            add(f"long{seed}-{longs_added}", args.long_len, 16)
            longs_added += 1
            steps_since = 0
    wall = time.perf_counter() - started
    gaps.sort()
    return {"output_tok_s": round(sum(seen.values()) / wall, 1), "wall_s": round(wall, 3),
            "itl_median_ms": round(1e3 * statistics.median(gaps), 2),
            "itl_p99_ms": round(1e3 * gaps[int(0.99 * (len(gaps) - 1))], 2),
            "long_ttft_s": [round(v, 3) for r, v in ttft.items() if r.startswith("long")],
            # where a run's time went: one-time costs show as a few steps far above the median
            "steps": len(step_s), "step_median_ms": round(1e3 * statistics.median(step_s), 2),
            "slowest_steps_ms": sorted((round(1e3 * v, 1) for v in step_s), reverse=True)[:5]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--workers-per-gpu", type=int, default=None)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--longs", type=int, default=2)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-every", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from raypp import LLM

    max_len = args.long_len + 64
    model = _checkpoint(args.model, max_len)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    options: dict[str, Any] = {"pipeline_parallel_size": args.pp, "enable_prefix_caching": False,
                               "max_model_len": max_len, "device": args.device,
                               "dtype": "float32" if args.device == "cpu" else "bfloat16"}
    engines = {}
    for i, (mode, kwargs) in enumerate(MODES.items()):
        if args.device == "cuda":  # every engine's workers share the one GPU; each engine
            # keeps 1 - gpu_memory_utilization of the device free, so the later ones count
            # the earlier ones' memory: 0.4 of the device each
            options.update(workers_per_gpu=args.workers_per_gpu or args.pp * len(MODES),
                           gpu_memory_utilization=0.8 * (i + 1) / len(MODES))
        engines[mode] = LLM(str(model), **options, **kwargs)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for llm in engines.values():  # warm-up, the full workload once: the one-time costs
            run_once(llm, vocab, args, seed=999)  # of its step shapes (on CUDA several s)
        for rep in range(args.reps):
            for mode, llm in engines.items():
                runs[mode].append(run_once(llm, vocab, args, seed=rep))
                print(mode, runs[mode][-1], flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print("| mode | output tok/s | chat ITL median (ms) | chat ITL p99 (ms) | long TTFT (s) |")
    print("|---|---|---|---|---|")
    for mode, rows in runs.items():
        print(f"| {mode} | " + ", ".join(str(r["output_tok_s"]) for r in rows) + " | "
              + ", ".join(str(r["itl_median_ms"]) for r in rows) + " | "
              + ", ".join(str(r["itl_p99_ms"]) for r in rows) + " | "
              + "; ".join(",".join(map(str, r["long_ttft_s"])) for r in rows) + " |")


if __name__ == "__main__":
    main()
