"""Chaos under load: stage kills while many clients stream, counted request by request.

``python -m benchmarks.chaos --model DIR [-pp 2] [--streams 32] [--kills 2] [--rounds 3]
[--max-tokens 160] [--plane cgraph] [--engine-args JSON] [--json OUT]`` (from the repository root, raypp
importable; CPU or GPU)

A real OpenAI server on loopback (uvicorn, the engine behind ``AsyncLLMEngine``), one
engine for the whole run. Each round: ``--streams`` concurrent greedy streaming
completions run once without a fault (the reference), then again while a killer
``ray.kill``s a stage ``--kills`` times (the stages in turn) at random moments (after a
random number of further chunks reached every stream; the next kill waits for the
workers to be replaced). Recorded per round and in total:

- requests completed / failed; streams whose text differs from the no-fault run;
  chunks received beyond or short of the reference (a token sent twice or skipped);
- the pause each stream saw across a kill (the longest gap between two of its chunks
  that spans the kill), as p50 / p99 / max over streams and kills;
- time to recover: kill → workers replaced, kill → the first chunk after the
  replacement (any stream), kill → every unfinished stream had one again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

PROMPTS = ["The list type", "A function definition", "The import statement", "x = [1, 2"]


class _Streams:
    """Per stream: (arrival time, text) of each chunk."""

    def __init__(self, n: int) -> None:
        self.chunks: list[list[tuple[float, str]]] = [[] for _ in range(n)]
        self.done: list[bool] = [False] * n
        self.errors: list[str | None] = [None] * n

    def text(self, i: int) -> str:
        return "".join(t for _, t in self.chunks[i])


async def _stream(client: Any, prompt: str, max_tokens: int, streams: _Streams, i: int) -> None:
    try:
        stream = await client.completions.create(
            model="m", prompt=prompt, stream=True, temperature=0, max_tokens=max_tokens,
            extra_body={"ignore_eos": True})
        async for c in stream:
            streams.chunks[i].append((time.monotonic(), c.choices[0].text))
    except Exception as e:  # noqa: BLE001 - a failed request is what this counts
        streams.errors[i] = f"{type(e).__name__}: {e}"
    streams.done[i] = True


async def _killer(engine: Any, streams: _Streams, kills: int, rng: random.Random,
                  log: list[dict], first: int) -> None:
    import ray

    for kill in range(kills):
        marks = [len(c) for c in streams.chunks]
        more = rng.randint(2, 30)
        while not all(d or len(c) >= m + more for c, m, d in zip(streams.chunks, marks,
                                                                 streams.done)):
            await asyncio.sleep(0.005)
        if all(streams.done):
            return
        before = engine.restarts
        stage = (first + kill) % engine.config.parallel.pipeline_parallel_size
        actor = ray.get_actor(f"raypp_worker_{stage}_0", namespace=engine.executor.namespace)
        killed_at = time.monotonic()
        ray.kill(actor, no_restart=True)
        # replaced: a restart began (counted) and ended (no restart pending)
        while ((engine.restarts == before or engine.recovery.needs_restart)
               and not engine.recovery.dead):
            await asyncio.sleep(0.01)
        log.append({"stage": stage, "killed_at": killed_at,
                    "replaced_at": time.monotonic()})


async def _round(url: str, engine: Any, n: int, max_tokens: int, kills: int,
                 rng: random.Random, first_kill: int = 0) -> tuple[_Streams, list[dict]]:
    import openai

    streams, log = _Streams(n), []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=600,
                                  max_retries=0) as client:
        jobs = [_stream(client, PROMPTS[i % 4] + " " * (i // 4), max_tokens, streams, i)
                for i in range(n)]
        if kills:
            jobs.append(_killer(engine, streams, kills, rng, log, first_kill))
        await asyncio.gather(*jobs)
    return streams, log


def _recovery(streams: _Streams, kill: dict) -> dict:
    """Pauses each stream saw across ``kill`` (its longest gap between chunks around the
    workers' replacement), and when streaming resumed after the replacement."""
    at, replaced = kill["killed_at"], kill["replaced_at"]
    pauses, resumed = [], []
    for chunks in streams.chunks:
        times = [t for t, _ in chunks]
        after = [t for t in times if t > replaced]
        if not after:
            continue  # finished before the workers were replaced
        before = [t for t in times if t <= at]
        window = [before[-1] if before else at] + [t for t in times if at < t <= after[0]]
        pauses.append(max(b - a for a, b in zip(window, window[1:])))
        resumed.append(after[0] - at)
    return {"pauses": pauses, "first_chunk_after_s": min(resumed, default=None),
            "all_resumed_s": max(resumed, default=None)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chaos(model: str, pp: int, n: int, kills: int, rounds: int, max_tokens: int, plane: str,
          seed: int, engine_args: dict | None = None) -> dict:
    from raypp import LLM
    from raypp.engine.async_engine import AsyncLLMEngine
    from raypp.entrypoints.openai.app import ServerConfig, build_app
    from raypp.testing.server import ServerThread

    rng = random.Random(seed)
    llm = LLM(model, pipeline_parallel_size=pp, control_plane=plane,
              max_restarts=kills * rounds + 1, **(engine_args or {}))
    engine = AsyncLLMEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(["m"], model))).start()
    per_round, pauses, replaced, first, everyone = [], [], [], [], []
    totals = {"requests": 0, "completed": 0, "failed": 0, "differing_streams": 0,
              "extra_chunks": 0, "missing_chunks": 0}
    try:
        for round_ in range(rounds):
            reference, _ = asyncio.run(_round(server.url, llm.engine, n, max_tokens, 0, rng))
            faulty, log = asyncio.run(_round(server.url, llm.engine, n, max_tokens, kills, rng,
                                             round_ * kills))
            failed = sum(e is not None for e in faulty.errors)
            differing = sum(faulty.text(i) != reference.text(i) for i in range(n)
                            if faulty.errors[i] is None)
            extra = sum(max(0, len(faulty.chunks[i]) - len(reference.chunks[i])) for i in range(n))
            missing = sum(max(0, len(reference.chunks[i]) - len(faulty.chunks[i]))
                          for i in range(n) if faulty.errors[i] is None)
            kills_info = []
            for kill in log:
                rec = _recovery(faulty, kill)
                pauses += rec["pauses"]
                replaced.append(kill["replaced_at"] - kill["killed_at"])
                if rec["first_chunk_after_s"] is not None:
                    first.append(rec["first_chunk_after_s"])
                    everyone.append(rec["all_resumed_s"])
                kills_info.append({"stage": kill["stage"],
                                   "replaced_s": kill["replaced_at"] - kill["killed_at"],
                                   "max_pause_s": max(rec["pauses"], default=None),
                                   "first_chunk_after_s": rec["first_chunk_after_s"],
                                   "all_resumed_s": rec["all_resumed_s"]})
            per_round.append({"kills": kills_info, "failed": failed, "differing": differing,
                              "errors": [e for e in faulty.errors if e][:3]})
            for key, value in (("requests", n), ("completed", n - failed), ("failed", failed),
                               ("differing_streams", differing), ("extra_chunks", extra),
                               ("missing_chunks", missing)):
                totals[key] += value
    finally:
        server.stop()
        engine.shutdown()
    return {
        "model": model, "pp": pp, "plane": plane, "streams": n, "kills_per_round": kills,
        "rounds": rounds, "max_tokens": max_tokens, "seed": seed,
        "engine_args": engine_args or {}, "device": llm.engine.config.device, **totals,
        "kills": len(replaced), "restarts": llm.engine.restarts,
        "pause_across_kill_s": {"p50": _pct(pauses, 0.5), "p99": _pct(pauses, 0.99),
                                "max": max(pauses, default=None), "n": len(pauses)},
        "kill_to_workers_replaced_s": _summary(replaced),
        "kill_to_first_chunk_s": _summary(first),
        "kill_to_all_streams_resumed_s": _summary(everyone),
        "per_round": per_round,
    }


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def main(argv: list[str] | None = None) -> None:
    from raypp.executor.stage_pool import ensure_ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--kills", type=int, default=2, help="kills per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--plane", default="cgraph", choices=["cgraph", "direct"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", type=json.loads, default=None,
                        help='more LLM options as JSON, e.g. \'{"workers_per_gpu": 2}\'')
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ensure_ray(None)
    result = chaos(args.model, args.pipeline_parallel_size, args.streams, args.kills,
                   args.rounds, args.max_tokens, args.plane, args.seed, args.engine_args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
