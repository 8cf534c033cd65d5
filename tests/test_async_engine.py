"""AsyncLLMEngine: streaming, concurrency, cancellation, validation, step failures.

One real pp=2 engine on the tiny Llama for the whole module. Its stage 1 is
armed with a real injected fault (``RAYPP_FAULT_INJECT``) at a step id the
engine only reaches when a test fast-forwards its step counter.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import psutil
import pytest

from raypp import LLM, SamplingParams
from raypp.engine.async_engine import AsyncLLMEngine
from raypp.errors import EngineDeadError

FAULT_STEP = 1_000_000
PROMPTS = ["The list type", "A function definition", "The import statement", "x = [1, 2"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_llama):
    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, kv_cache_memory_bytes=8 * 2**20,
              fault_inject=f"raise:1:{FAULT_STEP}")
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = AsyncLLMEngine(llm.engine, collect_stage_times=True)
    yield engine, refs
    engine.shutdown()


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _last(gen):
    return [out async for out in gen][-1]


def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_generate_streams_every_update_and_matches_llm(setup):
    engine, refs = setup
    outs = asyncio.run(_collect(engine, PROMPTS[0], GREEDY, "stream-0"))
    assert len(outs) == GREEDY.max_tokens  # one update per token
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 11))
    assert [o.finished for o in outs] == [False] * 9 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].outputs[0].text == refs[0]
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative


def test_concurrent_callers_on_two_event_loops(setup):
    engine, refs = setup
    results: dict[str, list[str]] = {}

    async def many(tag: str) -> None:
        outs = await asyncio.gather(*[
            _collect(engine, p, GREEDY, f"{tag}-{i}") for i, p in enumerate(PROMPTS)
        ])
        results[tag] = [o[-1].outputs[0].text for o in outs]

    other = threading.Thread(target=lambda: asyncio.run(many("thread")))
    other.start()
    asyncio.run(many("main"))
    other.join(60)
    assert results == {"main": refs, "thread": refs}
    _wait_idle(engine)


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_consumer_that_stops_aborts_and_frees_blocks(setup, how):
    engine, _ = setup
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume() -> int:
        seen = 0
        gen = engine.generate(PROMPTS[1], long, f"stop-{how}")
        async for out in gen:
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                break
        await gen.aclose()
        return seen

    async def cancel() -> int:
        task = asyncio.ensure_future(_collect(engine, PROMPTS[1], long, "stop-cancel"))
        while engine.stats().kv_blocks_used == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return 0

    assert asyncio.run(consume() if how == "break" else cancel()) < 200
    _wait_idle(engine)
    assert not engine.engine.requests


def test_stats_carry_the_engines_counters_and_load(setup):
    engine, _ = setup
    _wait_idle(engine)
    before = engine.stats()
    asyncio.run(_collect(engine, PROMPTS[2], GREEDY, "counted"))
    _wait_idle(engine)
    after = engine.stats()
    assert after.tokens_generated - before.tokens_generated == GREEDY.max_tokens
    assert after.steps > before.steps and after.steps == engine.engine.stats.steps
    assert after.kv_blocks_total == engine.engine.block_manager.num_blocks > 0
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(
        engine.engine.tokenizer.encode(PROMPTS[2]))


def test_invalid_requests_raise_before_streaming(setup):
    engine, refs = setup

    async def run() -> None:
        too_long = list(range(300))  # max_model_len is 256
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(too_long, GREEDY, "bad-0").__anext__()
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([], GREEDY, "bad-1").__anext__()
        # A duplicate id is refused without disturbing the request that owns it.
        first = engine.generate(PROMPTS[0], GREEDY, "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, PROMPTS[1], GREEDY, "dup")
        assert (await _last(first)).outputs[0].text == refs[0]

    asyncio.run(run())
    _wait_idle(engine)


def test_failed_step_fails_its_requests_and_the_loop_keeps_serving(setup):
    engine, refs = setup
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def run() -> list[object]:
        gens = [engine.generate(p, long, f"fail-{i}") for i, p in enumerate(PROMPTS[:2])]
        for gen in gens:  # both requests are running ...
            await gen.__anext__()
        # ... when the next step hits the armed fault (swapping the counter is atomic).
        engine.engine.step_builder._step_ids = itertools.count(FAULT_STEP)
        return await asyncio.gather(*[_last(g) for g in gens], return_exceptions=True)

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, Exception)]
    assert failed and all("injected fault" in str(e) for e in failed), results
    for r in results:
        if not isinstance(r, Exception):  # a request in another micro-batch may survive
            assert r.finished and len(r.outputs[0].token_ids) == 40
    _wait_idle(engine)
    outs = asyncio.run(_collect(engine, PROMPTS[2], GREEDY, "after-failure"))
    assert outs[-1].outputs[0].text == refs[2]
    assert engine.is_healthy()


def test_idle_loop_sleeps_and_stage_times_are_collected(setup):
    engine, _ = setup
    asyncio.run(_collect(engine, PROMPTS[0], GREEDY, "timed"))
    _wait_idle(engine)
    time.sleep(0.2)
    times = engine.pop_stage_times()
    assert {stage for stage, _ in times} == {0, 1}
    assert all(0 < s < 5 for _, s in times)

    def loop_cpu() -> float:
        tid = engine._thread.native_id
        t = next(t for t in psutil.Process().threads() if t.id == tid)
        return t.user_time + t.system_time

    before = loop_cpu()
    time.sleep(1.0)
    assert loop_cpu() - before < 0.05  # asleep, not polling


def test_shutdown_fails_new_and_inflight_requests(setup):
    engine, _ = setup
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        gen = engine.generate(PROMPTS[0], long, "inflight")
        await gen.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await engine.generate(PROMPTS[0], GREEDY, "late").__anext__()

    asyncio.run(run())
    assert not engine.is_healthy()
