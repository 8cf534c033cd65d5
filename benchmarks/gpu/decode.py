"""One-call GPU decode benchmark: raypp against transformers and the HBM roofline.

    python -m benchmarks.gpu.decode --out DIR [--budget-s 420] [--sections a,b] [--ckpt DIR]

(from the repository root, with raypp importable). In one process, on one GPU, it:

1. measures the copy bandwidth (bytes read + written) and the read bandwidth;
2. builds a Llama-architecture checkpoint of Llama-3.2-1B's shape with random
   weights (transformers' ``LlamaForCausalLM(config)`` on the GPU, then
   ``save_pretrained`` in bf16) and a word-level tokenizer covering its vocabulary;
3. correctness: raypp's greedy tokens against transformers' in fp32 (exact), and
   in bf16 (token agreement, and raypp's top-5 logprobs against transformers'
   logprobs teacher-forced on raypp's own sequence), both through multi-step decode;
4. raypp through the real engine (Ray, compiled graph, pp=1): decode tokens/s at
   each batch size and each ``num_decode_steps`` in ``DECODE_STEPS``, prompt 512,
   output 256, greedy, prefill phase timed apart, with the stage's busy time and
   the gaps between its steps; at batch 1 and 64, ``num_decode_steps=32`` also
   runs with ``async_scheduling`` off (A/B); then the same through the direct
   control plane at batch 1 and 64 with the two largest step counts;
5. the same stage in-process without Ray (``StageWorker``): per-step time split
   into graph replay (LM head inside), staging, sampling; one step vs 32 steps
   per call; eager vs graphs; a PyTorch profiler kernel breakdown;
6. transformers ``generate`` on the same checkpoint and batch sizes: eager (SDPA,
   dynamic cache), then static cache + ``torch.compile`` where time allows;
7. the roofline: bytes a decode step must read (weights once, plus the KV of
   every sequence) over the measured copy bandwidth;
8. the paged decode attention kernel alone at each batch size, over its number
   of context splits and its launch settings.

Sections (``--sections``, in run order): bandwidth, checkpoint, raypp_engine,
raypp_engine_direct, raypp_stage, hf_static_compile, raypp_fp32_check, correctness,
attention_splits, attention_launch, hf_eager. They run under one time budget (see
:mod:`benchmarks.harness`: a section that does not fit is skipped and listed, an
error is recorded and the next section runs, ``results.json`` is rewritten after
each). ``summary.txt`` (:mod:`benchmarks.gpu.decode_summary`) prints last.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks.cuda_timing import bandwidth
from benchmarks.gpu.decode_attention import attention_launch, attention_splits
from benchmarks.gpu.decode_correctness import correctness
from benchmarks.gpu.decode_engine import raypp_check, raypp_engine_bench
from benchmarks.gpu.decode_hf import hf_bench
from benchmarks.gpu.decode_stage import stage_bench
from benchmarks.gpu.decode_summary import summary
from benchmarks.gpu.decode_workload import (
    BATCHES,
    DECODE_STEPS,
    OUTPUT_LEN,
    PROMPT_LEN,
    SYNC_AB_BATCHES,
    make_checkpoint,
)
from benchmarks.harness import Run, add_run_args, cuda_card, parse_sections, software_versions


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.decode",
                                 description=__doc__.split("\n")[0])
    add_run_args(ap, out_default=os.environ.get("OUT", "bench_out"), budget_s=420.0,
                 sections=True)
    ap.add_argument("--ckpt", default="/tmp/raypp-llama-1b-random",
                    help="where the random-weight checkpoint is built")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="the engine sections' batch sizes (comma-separated)")
    ap.add_argument("--decode-steps", default=",".join(map(str, DECODE_STEPS)),
                    help="the engine section's decode steps per round trip (comma-separated)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    only = parse_sections(args.sections)
    out = Path(args.out)
    run = Run(out, args.budget_s, select=lambda name: only is None or name in only,
              cleanup=torch.cuda.empty_cache)
    r = run.results
    r["env"] = {
        **cuda_card(), **software_versions(),
        "shape": "Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 kv heads, vocab 128256, "
                 "tied), random weights, bf16",
        "workload": f"prompt {PROMPT_LEN}, output {OUTPUT_LEN}, greedy, ignore_eos",
    }
    r["bandwidth"] = run.section("bandwidth", bandwidth)
    bw = (r["bandwidth"] or {}).get("copy_GBps", 4300.0)
    ckpt = Path(args.ckpt)
    r["checkpoint"] = run.section("checkpoint", lambda: make_checkpoint(ckpt))
    weight_bytes = (r["checkpoint"] or {}).get("weight_bytes", 2 * 1_235_814_400)
    batches = tuple(int(b) for b in args.batches.split(","))
    steps = tuple(int(k) for k in args.decode_steps.split(","))
    r["raypp_engine"] = run.section("raypp_engine", lambda: raypp_engine_bench(
        ckpt, batches, run, decode_steps=steps), 60)
    bf16 = (r["raypp_engine"] or {}).pop("check", None)
    r["raypp_engine_direct"] = run.section("raypp_engine_direct", lambda: raypp_engine_bench(
        ckpt, SYNC_AB_BATCHES, run, "direct", DECODE_STEPS[-2:]), 60)
    r["raypp_stage"] = run.section("raypp_stage", lambda: stage_bench(
        ckpt, run, weight_bytes, bw), 60)
    r["hf_static_compile"] = run.section("hf_static_compile", lambda: hf_bench(ckpt, run, True),
                                         100)
    fp32 = run.section("raypp_fp32_check", lambda: raypp_check(ckpt, "float32", None), 60)
    r["raypp_check_tokens"] = {"fp32": fp32, "bf16": bf16}
    r["correctness"] = run.section("correctness", lambda: correctness(ckpt, fp32, bf16), 30)
    r["attention_splits"] = run.section("attention_splits", lambda: attention_splits(bw), 15)
    r["attention_launch"] = run.section("attention_launch", lambda: attention_launch(bw), 90)
    r["hf_eager"] = run.section("hf_eager", lambda: hf_bench(ckpt, run, False), 40)
    r["wall_s"] = round(run.elapsed(), 1)
    run.save()
    text = summary(r)
    (out / "summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
