"""Time to first token of one long prompt with chunked pipeline prefill on and off (CPU).

``python -m benchmarks.pipelined_prefill [--model tiny|bench|DIR] [--pp 2]
[--prompt-len 4096] [--reps 3] [--out FILE]``

One engine per mode, all started before measuring and used in turn (``off``, ``on``,
``on-fixed``, repeated ``--reps`` times) so drift of the machine shows as spread:
``off``: ``pipelined_prefill=False`` (a prompt longer than the step's token budget is
prefilled one chunk per round trip through all stages); ``on``: the default (chunks of
the budget over the stages, up to ``pp`` of them in flight, later ones shrunk as their
context grows); ``on-fixed``: ``balanced_prefill_chunks=False``. Each request is a fresh
random prompt of ``--prompt-len`` tokens (prefix caching off) generating one token;
TTFT is the wall time from ``add_request`` to the step that returns its token, read
through ``LLMEngine.step``. Everything else is the defaults for the device (CPU: a step
budget of 2,048 tokens), fp32. Models: ``tiny``, the tests' Llama (hidden 64, 6 layers)
with 8,192 positions; ``bench``, ``raypp bench make-model``'s default (hidden 512, 8
layers, 25 M parameters); or a checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = {"off": {"pipelined_prefill": False}, "on": {},
         "on-fixed": {"balanced_prefill_chunks": False}}


def _model(name: str) -> Path:
    from raypp.testing.tiny_model import make_tiny_model

    out = Path(tempfile.mkdtemp(prefix=f"raypp_pp_prefill_{name}_"))
    if name == "tiny":
        return make_tiny_model(out, architecture="llama", seed=0, max_position_embeddings=8192)
    if name == "bench":
        return make_tiny_model(out, architecture="llama", seed=0, hidden_size=512,
                               intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=8,
                               vocab_size=32000, max_position_embeddings=8192)
    return Path(name)


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``prompt``, and the micro-batches it took."""
    from raypp import SamplingParams

    engine = llm.engine
    steps_before = engine.stats.steps
    started = time.perf_counter()
    engine.add_request(f"r{started}", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started, engine.stats.steps - steps_before


def measure(model: Path, pp: int, prompt_len: int, reps: int) -> dict[str, Any]:
    from raypp import LLM

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    engines = {mode: LLM(str(model), pipeline_parallel_size=pp, dtype="float32",
                         enable_prefix_caching=False, max_model_len=prompt_len + 16, **kwargs)
               for mode, kwargs in MODES.items()}
    rows: dict[str, dict[str, Any]] = {m: {"ttft_s": [], "steps": None} for m in MODES}
    try:
        for llm in engines.values():  # warm-up: the first prefill pays one-time costs
            _ttft(llm, [rng.randrange(3, vocab) for _ in range(prompt_len)])
        for _ in range(reps):
            for mode, llm in engines.items():
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                seconds, steps = _ttft(llm, prompt)
                rows[mode]["ttft_s"].append(round(seconds, 4))
                rows[mode]["steps"] = steps
                rows[mode]["overlapped_chunks"] = llm.engine.scheduler.num_overlapped_chunks
    finally:
        for llm in engines.values():
            llm.shutdown()
    off = statistics.median(rows["off"]["ttft_s"])
    for row in rows.values():
        row["median_ttft_s"] = statistics.median(row["ttft_s"])
        row["speedup_vs_off"] = round(off / row["median_ttft_s"], 3)
    return {"pp": pp, "prompt_len": prompt_len, "modes": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]
    result = {"model": args.model, "load_avg_at_start": load,
              **measure(_model(args.model), args.pp, args.prompt_len, args.reps)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"model {args.model}, pp={args.pp}, prompt {args.prompt_len} tokens, "
          f"load at start {load}")
    print("| mode | TTFT median (s) | runs (s) | micro-batches | vs off |")
    print("|---|---|---|---|---|")
    for mode, row in result["modes"].items():
        print(f"| {mode} | {row['median_ttft_s']:.3f} | {', '.join(map(str, row['ttft_s']))} "
              f"| {row['steps']} | {row['speedup_vs_off']:.2f}x |")


if __name__ == "__main__":
    main()
