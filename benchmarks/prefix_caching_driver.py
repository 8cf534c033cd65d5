"""What prefix caching costs the engine's driver when nothing hits, without a model.

Runs the driver's own per-step work — ``Scheduler.schedule`` (admission with the cache
lookup, block allocation), ``StepBuilder.build`` (the step descriptor), ``Scheduler.complete``
(registering filled blocks, hashing them) and the token bookkeeping (append, finish,
free) — for distinct random prompts, caching on and off, each sampled token a constant.
Stage compute, which is the same either way, is left out, so the difference is not
drowned in a shared machine's noise the way an engine run's is.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import Scheduler
from raypp.engine.sequence import Sequence
from raypp.engine.step_builder import StepBuilder
from raypp.sampling_params import SamplingParams


def _one_run(num_prompts: int, prompt_len: int, output_len: int, caching: bool,
             seed: int) -> tuple[float, float, int, int]:
    """(prefill steps' seconds, decode steps' seconds, prefill steps, decode steps)."""
    rng = random.Random(seed)
    blocks = BlockManager(num_prompts * (prompt_len + output_len) // 16 + 64, 16, caching)
    sched = Scheduler(SchedulerConfig().size_for("cpu"), blocks, prompt_len + output_len + 16)
    builder = StepBuilder(sched)
    for i in range(num_prompts):
        sched.add(Sequence(i, str(i), 0, [rng.randrange(3, 30000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=output_len), seed=0))
    times = {True: 0.0, False: 0.0}
    counts = {True: 0, False: 0}
    while sched.has_unfinished():
        started = time.perf_counter()
        batch = sched.schedule()
        builder.build(batch)
        sched.complete(batch)
        for item in batch.seqs:
            if item.sample:
                item.seq.output_token_ids.append(7)
                if len(item.seq.output_token_ids) >= output_len:
                    sched.finish(item.seq)
        decode = all(item.num_tokens == 1 for item in batch.seqs)
        times[decode] += time.perf_counter() - started
        counts[decode] += 1
    return times[False], times[True], counts[False], counts[True]


def driver_cost(num_prompts: int, prompt_len: int, output_len: int,
                repeats: int = 7) -> dict[str, Any]:
    """Per caching setting, medians over ``repeats`` alternating runs: µs per prefill step,
    per decode step, and per request over the whole run."""
    runs: dict[str, list[tuple[float, float, int, int]]] = {"on": [], "off": []}
    for r in range(repeats):
        for caching in (True, False) if r % 2 == 0 else (False, True):
            runs["on" if caching else "off"].append(
                _one_run(num_prompts, prompt_len, output_len, caching, seed=r))
    out: dict[str, Any] = {"num_prompts": num_prompts, "prompt_len": prompt_len,
                           "output_len": output_len, "repeats": repeats}
    for key, rs in runs.items():
        out[key] = {
            "prefill_us_per_step": round(statistics.median(1e6 * p / n for p, _, n, _ in rs), 1),
            "decode_us_per_step": round(statistics.median(1e6 * d / m for _, d, _, m in rs), 1),
            "us_per_request": round(statistics.median(1e6 * (p + d) / num_prompts
                                                      for p, d, _, _ in rs), 1),
            "prefill_steps": rs[0][2], "decode_steps": rs[0][3],
        }
    return out
