"""Fault timings: kill-to-replaced and kill-to-batch-done, and idle CPU per stage.

``python -m benchmarks.faults --model DIR [-pp 2] [--kills 10] [--json OUT]`` (from the
repository root, raypp importable; formerly ``python -m raypp.bench.faults``)

Each round starts a long batch, kills one stage actor (``ray.kill``, rotating
over the stages) one second in, and records how long until the workers were
replaced and until the batch finished (its requests are re-queued, not failed:
failures are counted). ``benchmarks/chaos.py`` measures the same under streaming
load. Idle CPU is measured per stage process over a few idle seconds, with
the compiled graph suspended (raypp's default) and kept compiled (``RAYPP_IDLE_SUSPEND_S=0``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time


def kill_timings(model: str, pp: int, kills: int) -> dict:
    """Per kill: how long until the workers were replaced, and until the batch it hit
    finished (every request completes since recovery re-queues them; failures counted)."""
    import ray

    from raypp import LLM, RequestFailedError, SamplingParams

    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    to_replaced, to_done, failed = [], [], 0
    with LLM(model, pipeline_parallel_size=pp, max_restarts=kills + 1) as llm:
        batch = [{"prompt_token_ids": [1, 2, 3, 4]}] * 8
        for round_ in range(kills):
            stage = round_ % pp
            victim = llm.engine.executor.workers[stage][0]
            killed_at: list[float] = []
            replaced_at: list[float] = []

            def kill(victim=victim, killed_at=killed_at, replaced_at=replaced_at) -> None:
                time.sleep(1.0)
                before = llm.engine.restarts
                killed_at.append(time.monotonic())
                ray.kill(victim, no_restart=True)
                while llm.engine.restarts == before and time.monotonic() - killed_at[0] < 600:
                    time.sleep(0.01)
                replaced_at.append(time.monotonic())

            thread = threading.Thread(target=kill, daemon=True)
            thread.start()
            try:
                llm.generate(batch, long, use_tqdm=False)
            except RequestFailedError as e:
                failed += len(e.errors)
            done = time.monotonic()
            thread.join()
            if done < killed_at[0]:
                raise RuntimeError("generation finished before the kill: use a longer batch")
            to_replaced.append(replaced_at[0] - killed_at[0])
            to_done.append(done - killed_at[0])
    return {"kills": kills, "requests_failed": failed,
            "kill_to_workers_replaced_s": _summary(to_replaced),
            "kill_to_batch_done_s": _summary(to_done)}


def idle_cpu(model: str, pp: int, seconds: float, suspend_s: float) -> list[float]:
    """Fraction of one core used by each stage process while the engine idles."""
    import ray

    from raypp import LLM, SamplingParams
    from raypp.testing import cpu_fraction

    with LLM(model, pipeline_parallel_size=pp, idle_suspend_s=suspend_s) as llm:
        llm.generate("A", SamplingParams(max_tokens=4), use_tqdm=False)
        time.sleep(max(2.0, suspend_s + 1.5))
        pids = ray.get([w.ping.remote() for w in llm.engine.executor.all_workers])
        return [round(u, 4) for u in cpu_fraction(pids, seconds)]


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "n": len(ordered)}


def main(argv: list[str] | None = None) -> None:
    from raypp.executor.stage_pool import ensure_ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ensure_ray(None)
    result = kill_timings(args.model, args.pipeline_parallel_size, args.kills)
    result["idle_cpu_per_stage_suspended"] = idle_cpu(args.model, args.pipeline_parallel_size,
                                                      args.idle_seconds, 1.0)
    result["idle_cpu_per_stage_compiled"] = idle_cpu(args.model, args.pipeline_parallel_size,
                                                    args.idle_seconds, 0.0)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
