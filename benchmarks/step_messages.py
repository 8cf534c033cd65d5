"""Lean step messages vs whole block tables: bytes and CPU time per decode step (no model).

``python -m benchmarks.step_messages [--batches 64,256] [--context 2048] [--steps 64]``

A decode batch of N sequences at a context of about ``--context`` tokens (prompt
lengths staggered over one block, so tables grow on different steps, as they do in
serving) is driven through the real Scheduler, BlockManager and StepBuilder; each
step's result is faked (one token per sequence). Per decode step it reports:

- ``new``: the step as sent (``seq_ids`` + block-table changes): pickled bytes, and
  the time to build it, pickle it, unpickle it and resolve it against a stage's
  mirror (``BlockTableMirror``);
- ``old``: the same step with each row's whole table and no changes (what every step
  carried before): pickled bytes, and the time to build it (the former builder's
  loop, ``list(seq.block_table)`` per row), pickle and unpickle it.

On a pipeline the unpickle (and resolve) is paid on every stage, and on the compiled
graph every stage also pickles the hand-off's step for the next one, so the per-stage
columns are listed apart. Median and mean over ``--steps`` decode steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import time
from typing import Any

from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence
from raypp.engine.step_builder import StepBuilder, sampling_batch
from raypp.sampling_params import SamplingParams
from raypp.step import ResolvedStep
from raypp.worker.block_tables import BlockTableMirror

BLOCK_SIZE = 16


def old_build(batch: MicroBatch, blocks: BlockManager, step_id: int) -> ResolvedStep:
    """The former StepBuilder.build: every row's whole table (as a ResolvedStep with no
    sequence ids or changes, which pickles like the former StepInput)."""
    ids, positions, slots, query_start, seq_lens, tables, rows = [], [], [], [0], [], [], []
    sampled = []
    for item in batch.seqs:
        seq, start = item.seq, item.start
        end = start + item.num_tokens
        ids.extend(seq.all_token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks.slot(seq, p) for p in range(start, end))
        query_start.append(len(ids))
        seq_lens.append(end)
        tables.append(list(seq.block_table))
        if item.sample:
            rows.append(len(ids) - 1)
            sampled.append((seq, len(seq.output_token_ids)))
    return ResolvedStep(step_id=step_id, input_ids=ids, positions=positions,
                        query_start=query_start, seq_lens=seq_lens, seq_ids=[],
                        slot_mapping=slots, sample_rows=rows,
                        sampling=sampling_batch(sampled) if sampled else None,
                        block_tables=tables)


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e6


def run(batch_size: int, context: int, steps: int) -> dict[str, Any]:
    num_blocks = batch_size * (context // BLOCK_SIZE + 4)
    blocks = BlockManager(num_blocks, BLOCK_SIZE, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=batch_size * context,
                             max_inflight=1, num_decode_steps=1)
    sched = Scheduler(config, blocks, max_model_len=context + steps + BLOCK_SIZE)
    builder, mirror = StepBuilder(sched), BlockTableMirror(BLOCK_SIZE)
    for i in range(batch_size):  # contexts end at every offset within a block
        prompt = [(7 * i + j) % 30000 for j in range(context - steps // 2 - i % BLOCK_SIZE)]
        sched.add(Sequence(i, str(i), 0, prompt, SamplingParams(max_tokens=10 * steps), seed=0))

    def advance(batch: MicroBatch) -> None:
        sched.complete(batch)
        for item in batch.seqs:
            item.seq.output_token_ids.append(1)

    prefill = sched.schedule()
    assert prefill is not None and len(prefill.seqs) == batch_size
    mirror.resolve(builder.build(prefill))  # every table whole, once
    advance(prefill)
    rows: dict[str, list[float]] = {k: [] for k in (
        "new_bytes", "old_bytes", "new_build_us", "old_build_us", "new_pickle_us",
        "old_pickle_us", "new_unpickle_us", "old_unpickle_us", "resolve_us")}
    gc.collect()
    for _ in range(steps):
        batch = sched.schedule()
        assert batch is not None and len(batch.seqs) == batch_size and batch.num_steps == 1
        step, t_build = _timed(lambda b=batch: builder.build(b))
        old, t_old_build = _timed(lambda b=batch, i=step.step_id: old_build(b, blocks, i))
        data, t_pickle = _timed(lambda s=step: pickle.dumps(s, protocol=5))
        old_data, t_old_pickle = _timed(lambda s=old: pickle.dumps(s, protocol=5))
        got, t_unpickle = _timed(lambda d=data: pickle.loads(d))
        _, t_old_unpickle = _timed(lambda d=old_data: pickle.loads(d))
        resolved, t_resolve = _timed(lambda s=got: mirror.resolve(s))
        assert resolved.block_tables == old.block_tables
        for key, value in (("new_bytes", len(data)), ("old_bytes", len(old_data)),
                           ("new_build_us", t_build), ("old_build_us", t_old_build),
                           ("new_pickle_us", t_pickle), ("old_pickle_us", t_old_pickle),
                           ("new_unpickle_us", t_unpickle), ("old_unpickle_us", t_old_unpickle),
                           ("resolve_us", t_resolve)):
            rows[key].append(value)
        advance(batch)
    out: dict[str, Any] = {"batch": batch_size, "context": context, "steps": steps}
    for key, values in rows.items():
        out[key] = {"median": round(statistics.median(values), 1),
                    "mean": round(statistics.fmean(values), 1), "max": round(max(values), 1)}
    for kind in ("new", "old"):
        per_stage = [a + b for a, b in zip(rows[f"{kind}_unpickle_us"],
                                           rows["resolve_us"] if kind == "new"
                                           else [0.0] * steps)]
        total = [a + b + c for a, b, c in zip(rows[f"{kind}_build_us"], rows[f"{kind}_pickle_us"],
                                              per_stage)]
        out[f"{kind}_stage_us"] = round(statistics.median(per_stage), 1)
        out[f"{kind}_total_us"] = round(statistics.median(total), 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=2048, help="tokens in context, about")
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured")
    parser.add_argument("--json", action="store_true", help="print the full results as JSON")
    args = parser.parse_args(argv)
    results = [run(int(b), args.context, args.steps) for b in args.batches.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"decode steps at ~{args.context} tokens of context, block size {BLOCK_SIZE}; "
          f"medians over {args.steps} steps (bytes: median / max)")
    print("| batch | bytes old | bytes new | build+pickle old µs | build+pickle new µs "
          "| per stage old µs (unpickle) | per stage new µs (unpickle+resolve) "
          "| total old µs | total new µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        old_send = r["old_build_us"]["median"] + r["old_pickle_us"]["median"]
        new_send = r["new_build_us"]["median"] + r["new_pickle_us"]["median"]
        print(f"| {r['batch']} | {r['old_bytes']['median']:.0f} / {r['old_bytes']['max']:.0f} "
              f"| {r['new_bytes']['median']:.0f} / {r['new_bytes']['max']:.0f} "
              f"| {old_send:.0f} | {new_send:.0f} | {r['old_stage_us']:.0f} "
              f"| {r['new_stage_us']:.0f} | {r['old_total_us']:.0f} | {r['new_total_us']:.0f} |")


if __name__ == "__main__":
    main()
