"""Where the engine's host time per decode round goes, on CPU with a tiny model.

    PYTHONPATH=src python -m benchmarks.gpu.engine_host_split [--seqs 64] [--steps 32]

(from the repository root; formerly ``scripts/engine_host_split.py``). Starts an engine
(local Ray cluster, one CPU stage, compiled-graph plane) on a generated tiny Llama, runs
``--seqs`` sequences of 256 greedy tokens with ``num_decode_steps=--steps`` three
times (the first is warm-up), and prints per decode round the milliseconds spent in
each step of the engine's loop: ``append_results`` (the output processor),
``schedule``, ``build_step`` and ``submit`` come before the next round reaches the
stage (the device waits for them); ``finish_text`` runs while it computes; ``result``
is the wait for the stage. benchmarks/gpu/README.md (run 9) quotes it, from before the
engine's split into step builder and output processor (``_append_results``,
``_build_step`` and ``_finish_text`` were the engine's methods then).
"""

from __future__ import annotations

import argparse
import functools
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from raypp import LLM, SamplingParams
from raypp.engine.output_processor import OutputProcessor
from raypp.engine.scheduler import Scheduler
from raypp.engine.step_builder import StepBuilder
from raypp.executor.cgraph import CompiledGraphExecutor
from raypp.testing.tiny_model import make_tiny_model

SPENT: defaultdict[str, float] = defaultdict(float)


def _timed(cls: type, name: str, label: str | None = None) -> None:
    """Wrap ``cls.name`` so that its time adds up in ``SPENT[label or name]``."""
    inner = getattr(cls, name)
    label = label or name

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - started

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.engine_host_split",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    for name in ("append_results", "finish_text"):
        _timed(OutputProcessor, name)
    _timed(StepBuilder, "build", "build_step")
    _timed(Scheduler, "schedule")
    for name in ("submit", "result"):
        _timed(CompiledGraphExecutor, name)
    model = make_tiny_model(Path(tempfile.mkdtemp()), architecture="llama", seed=0)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    with LLM(str(model), device="cpu", dtype="float32", max_num_seqs=args.seqs,
             num_decode_steps=args.steps, control_plane="cgraph") as llm:
        engine = llm.engine
        for run in ("warm-up", "run 1", "run 2"):
            for i in range(args.seqs):
                prompt = [rng.randrange(3, 200) for _ in range(32)]
                engine.add_request(f"{run}-{i}", {"prompt_token_ids": prompt}, params)
            first: set[str] = set()
            engine.emit_unfinished = True  # prefill phase: until every sequence has a token
            while len(first) < args.seqs:
                first.update(out.request_id for out in engine.step())
            engine.emit_unfinished = False
            SPENT.clear()
            rounds = 0
            while engine.has_unfinished_requests():
                engine.step()
                rounds += 1
            print(run, f"{rounds} decode rounds, ms per round:",
                  {name: round(1e3 * s / rounds, 3) for name, s in SPENT.items()})


if __name__ == "__main__":
    main()
