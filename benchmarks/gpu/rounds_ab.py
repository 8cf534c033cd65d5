"""Decode throughput of two raypp trees side by side, with the engine's defaults (GPU).

``python -m benchmarks.gpu.rounds_ab --out DIR --tree before=PATH --tree after=PATH
[--batches 1,64] [--reps 2] [--budget-s 400]``

Each ``PATH`` is a raypp source folder (the one holding the ``raypp`` package, e.g. a
``src/`` exported from another commit). For each tree in turn, a fresh process imports
raypp from that folder (everything else, this script and the checkpoint included, is
shared), starts ``LLM`` on a random-weight Llama of Llama-3.2-1B's shape in bf16 with
the defaults (``max_model_len`` 1024 and ``gpu_memory_utilization`` 0.5 aside), and at
each batch size generates 256 greedy tokens (``ignore_eos``) after a 512-token random
prompt per sequence, ``--reps`` times, through ``LLMEngine.step`` as ``LLM.generate``
does. It reports decode tokens/s (from the step after every sequence has its first
token to the end) and the whole run's wall time. The trees alternate (before, after,
before, after, …) while the budget lasts, so drift of the card shows as spread.
Results: ``DIR/rounds_ab.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN, OUTPUT_LEN = 512, 256


def measure(ckpt: Path, batches: list[int], reps: int) -> dict[str, Any]:
    """In this process: decode tokens/s per batch size, ``reps`` runs each."""
    from benchmarks.gpu.decode_workload import random_prompts
    from raypp import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.5)
    out: dict[str, Any] = {"startup_s": round(time.perf_counter() - started, 1)}
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        llm.generate(random_prompts(2, 64, 1), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm
        for batch in batches:
            runs = []
            for rep in range(reps):
                prompts = random_prompts(batch, PROMPT_LEN, 100 + batch)
                runs.append(_decode_run(engine, prompts, params, f"b{batch}r{rep}"))
            out[f"b{batch}"] = runs
    finally:
        llm.shutdown()
    return out


def _decode_run(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    started = time.perf_counter()
    have_first: set[str] = set()
    engine.emit_unfinished = True
    while len(have_first) < len(ids):
        have_first.update(out.request_id for out in engine.step())
    decode_from = time.perf_counter()
    engine.emit_unfinished = False
    generated = engine.stats.tokens_generated
    while engine.has_unfinished_requests():
        engine.step()
    ended = time.perf_counter()
    tokens = engine.stats.tokens_generated - generated
    return {"decode_tok_s": round(tokens / (ended - decode_from), 1),
            "wall_s": round(ended - started, 3), "decode_tokens": tokens}


def _worker(args: argparse.Namespace) -> None:
    import raypp
    from benchmarks.gpu.decode_workload import make_checkpoint

    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        make_checkpoint(ckpt)
    result = measure(ckpt, [int(b) for b in args.batches.split(",")], args.reps)
    result["raypp"] = str(Path(raypp.__file__).parent)
    print("RESULT " + json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--ckpt", default="/tmp/raypp_rounds_ab_1b")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trees = dict(t.split("=", 1) for t in args.tree)
    deadline = time.perf_counter() + args.budget_s
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    rounds = 0
    while True:
        for label, path in trees.items():
            left = deadline - time.perf_counter()
            if left < 60:
                break
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(path).resolve()), os.environ.get("PYTHONPATH", ""), os.getcwd()])}
            cmd = [sys.executable, "-m", "benchmarks.gpu.rounds_ab", "--out", str(out),
                   "--tree", f"{label}={path}", "--batches", args.batches,
                   "--reps", str(args.reps), "--ckpt", args.ckpt, "--worker"]
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=left)
            except subprocess.TimeoutExpired:
                results[label].append({"error": "timeout"})
                break
            (out / f"rounds_ab_{label}_{rounds}.log").write_text(done.stdout + done.stderr)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            results[label].append(json.loads(lines[-1][7:]) if lines
                                  else {"error": done.stderr[-2000:]})
            (out / "rounds_ab.json").write_text(json.dumps(results, indent=1))
        else:
            rounds += 1
            continue
        break
    print(summary(results, args.batches.split(",")))


def summary(results: dict[str, list[dict[str, Any]]], batches: list[str]) -> str:
    lines = ["| tree | batch | decode tok/s (each run) | median |", "|---|---|---|---|"]
    for label, procs in results.items():
        for b in batches:
            runs = [r["decode_tok_s"] for p in procs for r in p.get(f"b{b}", [])]
            if runs:
                lines.append(f"| {label} | {b} | {', '.join(f'{x:.0f}' for x in runs)} "
                             f"| {statistics.median(runs):.0f} |")
        for p in procs:
            if "error" in p:
                lines.append(f"| {label} | error | {p['error'][-300:]!r} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
