"""Structured outputs on the GPU (issue 29's target): decode throughput at batch 64 of a
1B-shaped Llama (Llama-3.2-1B's shape, vocab 128,256, bf16, random weights), every
request constrained by a JSON schema vs none, and the longest gap in unconstrained
streams while a large new schema compiles. Also the bitmask's per-step cost on this
host (driver fill, pickling) and its application on the GPU.

The checkpoint carries a byte-level BPE tokenizer of the full vocabulary
(:func:`benchmarks.structured_outputs.byte_bpe_tokenizer`): a grammar needs tokens that
spell JSON, which the decode benchmark's word-level tokenizer has not.

Run from the repository root on the GPU machine (see ``benchmarks/gpu/README.md``):
``python -m benchmarks.gpu.structured_decode --out $OUT``. Target: the constrained run
decodes at ≥ 90 % of the unconstrained run's tokens/s at batch 64, and the compile
stall stays within the unconstrained stream's own step-time jitter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.checkpoints import sharp_init_checkpoint
from benchmarks.gpu.decode_workload import SHAPE_1B, random_prompts
from benchmarks.structured_outputs import ENDLESS, byte_bpe_tokenizer, mask_cost

PROMPT_LEN, OUTPUT_LEN = 128, 256


def make_checkpoint(path: Path) -> None:
    if not (path / "config.json").is_file():
        sharp_init_checkpoint(path, {k: v for k, v in SHAPE_1B.items()
                                     if k not in ("rms_norm_eps", "bos_token_id", "eos_token_id",
                                                  "pad_token_id")})
    byte_bpe_tokenizer(SHAPE_1B["vocab_size"]).save_pretrained(path)


def throughput(path: Path, batches: list[int], reps: int) -> dict[str, Any]:
    from raypp import LLM, SamplingParams, StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=ENDLESS))
    out: dict[str, Any] = {}
    with LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
             max_model_len=1024, gpu_memory_utilization=0.5) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], forced, use_tqdm=False)  # compiles once
        for batch in batches:
            prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, PROMPT_LEN, seed=batch)]
            row: dict[str, Any] = {}
            for name, params in (("unconstrained", free), ("json_schema", forced)):
                llm.generate(prompts, params, use_tqdm=False)  # warm: graphs, caches
                rates = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                                 / (time.perf_counter() - t0))
                row[f"{name}_tok_s"] = round(statistics.median(rates), 1)
            row["constrained_vs_free"] = round(row["json_schema_tok_s"] / row["unconstrained_tok_s"], 3)
            out[f"batch_{batch}"] = row
            print(batch, row, flush=True)
    return out


def compile_stall(path: Path, streams: int = 64) -> dict[str, Any]:
    from raypp import SamplingParams, StructuredOutputsParams
    from raypp.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_model(str(path), device="cuda", dtype="bfloat16",
                                       max_num_seqs=streams, max_model_len=1024,
                                       gpu_memory_utilization=0.5)
    structured = engine.engine.structured
    structured.compile(StructuredOutputsParams(regex="a"))  # the vocabulary indexed once
    prompts = random_prompts(streams, PROMPT_LEN, seed=3)

    def big_schema(seed: int) -> StructuredOutputsParams:
        props = {f"f{seed}_{i}": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "[a-z]{3,9}"}, "b": {"enum": [f"v{j}" for j in range(30)]},
            "c": {"type": "array", "items": {"type": "number"}}}, "required": ["a", "b", "c"]}
            for i in range(60)}
        return StructuredOutputsParams(json={"type": "object", "properties": props,
                                             "required": list(props)})

    async def run(seed: int | None) -> dict[str, float]:
        gaps: list[float] = []
        started: dict[str, Any] = {}

        async def one(i: int) -> None:
            last = None
            params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, f"{seed}-{i}"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                # rounds deliver several tokens at once: the first output at or past 64
                if (i == 0 and seed is not None and len(out.outputs[0].token_ids) >= 64
                        and "future" not in started):
                    started["t"] = now
                    future = started["future"] = structured.submit(big_schema(seed))
                    future.add_done_callback(lambda _: started.setdefault("done", time.perf_counter()))

        await asyncio.gather(*[one(i) for i in range(streams)])
        streams_done = time.perf_counter()
        row = {"max_gap_ms": round(1e3 * max(gaps), 2),
               "p99_gap_ms": round(1e3 * sorted(gaps)[int(0.99 * (len(gaps) - 1))], 2)}
        if seed is not None:  # the compile may outlast the streams: wait for it
            started["future"].result(timeout=300)
            row["compile_s"] = round(started["done"] - started["t"], 3)
            row["compile_outlasted_streams"] = started["done"] > streams_done
        return row

    try:
        return {"without_compile": [asyncio.run(run(None)) for _ in range(2)],
                "while_compiling": [asyncio.run(run(k)) for k in range(2)]}
    finally:
        engine.shutdown()


def apply_on_gpu(rows: int = 64) -> dict[str, Any]:
    import torch

    from raypp.step import SamplingBatch
    from raypp.worker.logits_processors import shape_logits

    vocab = SHAPE_1B["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    masks = [bytes(torch.randint(0, 256, ((vocab + 31) // 32 * 4,), generator=gen,
                                 dtype=torch.uint8).tolist()) for _ in range(rows)]
    z = [0.0] * rows
    batch = SamplingBatch(z, [1.0] * rows, [0] * rows, z, [0] * rows, [0] * rows, [-1] * rows,
                          z, z, [1.0] * rows, token_bitmask=masks)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        shape_logits(logits, batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"rows": rows, "vocab": vocab, "median_ms": round(1e3 * statistics.median(times[5:]), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default="/tmp/raypp_llama1b_bytebpe")
    parser.add_argument("--sections", default="mask,apply,throughput,stall")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    out, path = Path(args.out), Path(args.ckpt)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    results: dict[str, Any] = {}

    def record(name: str, value: Any) -> None:  # written as each section ends: a time
        results[name] = value                    # limit keeps what finished
        (out / "structured_decode.json").write_text(json.dumps(results, indent=1) + "\n")

    if "mask" in sections:
        record("mask_host", mask_cost())
    if "apply" in sections:
        record("apply_gpu_bf16", apply_on_gpu())
    if {"throughput", "stall"} & set(sections):
        make_checkpoint(path)
    if "throughput" in sections:
        record("throughput", throughput(path, [1, 64], args.reps))
    if "stall" in sections:
        record("stall", compile_stall(path))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
