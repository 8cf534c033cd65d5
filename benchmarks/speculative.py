"""Speculative decoding (n-gram, draft model) against plain decoding on the demo model,
batch 1 (CPU).

``python -m benchmarks.speculative [--pp 1,2] [--k 4] [--methods ngram,draft_model]
[--draft PATH] [--task repeat|open] [--reps 3] [--max-tokens 128]
[--out benchmarks/speculative_cpu.json]``

SmolLM2-135M-Instruct (the demo GGUF) answers one chat request: ``repeat`` asks it to
repeat a paragraph (a prompt that quotes its input: the case prompt lookup is for),
``open`` asks an open question (little to look up: what speculation costs where it
cannot help); greedy,
``--max-tokens`` tokens. Per pipeline size, one engine without speculation and one per
``--k`` and ``--methods`` entry (``{"method": "ngram", "num_speculative_tokens": k}``, or
``"draft_model"`` with ``--draft`` as the draft, by default the demo model itself: every
draft accepted, the upper bound of acceptance, at the cost of running the target twice)
run the request ``--reps`` times each after a warm-up; the engines alternate within a
pipeline size (every engine with ``max_model_len=4096``). Reported: output tokens/s of
the whole request (prefill included), median over the repetitions, the speed-up over
plain decoding, the mean accepted length (tokens per verification) and acceptance rate,
and whether the text equals the plain run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the "
    "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution. Although initially criticised by some of France's leading artists "
    "and intellectuals for its design, it has since become a global cultural icon of France.")
TASKS = {
    "repeat": [{"role": "user", "content": "Repeat the following paragraph exactly, word for "
                                           "word:\n\n" + PARAGRAPH}],
    "open": [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                                         "finds a message in a bottle."}],
}


def _run(llm: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, Any]:
    from raypp import SamplingParams

    started = time.perf_counter()
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return time.perf_counter() - started, out


def measure(pp: int, ks: list[int], reps: int, max_tokens: int, methods: list[str],
            draft: str | None = None, task: str = "repeat") -> dict[str, Any]:
    from raypp import LLM, SamplingParams

    path = "demo"  # SmolLM2-135M-Instruct, fetched into the cache on first use
    configs: list[dict[str, Any] | None] = [None]
    for method in methods:
        extra = {"model": draft or path} if method == "draft_model" else {}
        configs += [{"method": method, "num_speculative_tokens": k, **extra} for k in ks]
    # max_model_len 4096 for every engine, as in the recorded runs (a draft's KV shares
    # stage 0's KV budget)
    engines = [LLM(path, pipeline_parallel_size=pp, max_model_len=4096, speculative_config=c)
               for c in configs]
    rows: list[dict[str, Any]] = [{"speculative_config": c, "tok_s": [], "text": None,
                                   "metrics": None} for c in configs]
    try:
        for llm in engines:
            llm.chat(TASKS[task], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        for _ in range(reps):
            for llm, row in zip(engines, rows, strict=True):
                seconds, out = _run(llm, TASKS[task], max_tokens)
                row["tok_s"].append(round(len(out.outputs[0].token_ids) / seconds, 2))
                row["text"], row["metrics"] = out.outputs[0].text, out.metrics
    finally:
        for llm in engines:
            llm.shutdown()
    plain = statistics.median(rows[0]["tok_s"])
    for row in rows:
        row["median_tok_s"] = statistics.median(row["tok_s"])
        row["speedup"] = round(row["median_tok_s"] / plain, 3)
        row["same_text"] = row["text"] == rows[0]["text"]
        metrics = row.pop("metrics")
        row["mean_accepted_length"] = metrics.get("spec_mean_accepted_length")
        row["acceptance_rate"] = metrics.get("spec_acceptance_rate")
    return {"pp": pp, "runs": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="1,2")
    parser.add_argument("--k", default="4")
    parser.add_argument("--methods", default="ngram", help="ngram, draft_model, or both")
    parser.add_argument("--draft", default=None, help="the draft model (default: the demo "
                                                      "model itself)")
    parser.add_argument("--task", default="repeat", choices=sorted(TASKS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    results = {"load_avg_at_start": [round(x, 2) for x in load], "max_tokens": args.max_tokens,
               "task": args.task,
               "results": [measure(int(p), [int(k) for k in args.k.split(",")], args.reps,
                                   args.max_tokens, args.methods.split(","), args.draft,
                                   args.task)
                           for p in args.pp.split(",")]}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print("| pp | speculative | tok/s (median) | speed-up | mean accepted length | "
          "acceptance | same text |")
    print("|---|---|---|---|---|---|---|")
    for r in results["results"]:
        for row in r["runs"]:
            c = row["speculative_config"]
            name = "off" if c is None else f"{c['method']} k={c['num_speculative_tokens']}"
            print(f"| {r['pp']} | {name} | {row['median_tok_s']:.1f} | {row['speedup']:.2f}x "
                  f"| {row['mean_accepted_length'] or '-'} | {row['acceptance_rate'] or '-'} "
                  f"| {row['same_text']} |")


if __name__ == "__main__":
    main()
