"""Zero-loss recovery: a stage that dies costs no request, wherever the pipeline was.

Real stage actors are killed with ``ray.kill`` at chosen points of a real engine's run
(a prefill chunk in flight, a decode round in flight, the driver reading a result); the
requests must complete exactly as transformers computes them. A poison request (one
whose prompt makes the stage process exit: ``fault_inject="poison:…"``) is failed after
two deaths and the others complete. The strike rules themselves are unit-tested on the
plain-Python quarantine.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
import transformers
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, ErrorKind, RequestFailedError, SamplingParams
from raypp.engine.quarantine import Quarantine
from raypp.engine.sequence import Request, Sequence
from raypp.engine.tokenizer import load_tokenizer
from raypp.step import StepMode

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def _kill(engine, pp_rank: int) -> None:
    """Kill a stage actor and return once it is dead (``ray.kill`` only asks), so the
    steps still to come meet the death."""
    actor = ray.get_actor(f"raypp_worker_{pp_rank}_0", namespace=engine.executor.namespace)
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError("the killed stage actor still answers")


def _drive(engine, prompts: list[list[int]], params: SamplingParams, before_step) -> list[list[int]]:
    """Run ``prompts`` on ``engine`` step by step, calling ``before_step(engine)`` before
    each step; every request's output tokens (all must finish without error)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    deadline = time.monotonic() + 300  # a liveness bound, not a speed target
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"stuck with {len(done)} of {len(ids)} done"
        before_step(engine)
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


class _KillOnce:
    """Kills stage ``pp_rank`` before the first step at which ``ready(engine)`` holds."""

    def __init__(self, pp_rank: int, ready) -> None:
        self.pp_rank, self.ready, self.fired = pp_rank, ready, False

    def __call__(self, engine) -> None:
        if not self.fired and self.ready(engine):
            self.fired = True
            _kill(engine, self.pp_rank)


def _prefill_chunk_in_flight(engine) -> bool:
    return any(not item.sample for f in engine._inflight for item in f.batch.seqs)


def _decode_round_in_flight(engine) -> bool:
    return (any(f.batch.mode is StepMode.DECODE_ROUND and f.batch.num_steps > 1
                for f in engine._inflight)
            and min((len(s.output_token_ids) for s in engine.scheduler.running), default=0) >= 4)


@pytest.mark.parametrize("plane, pp, stage, ready, options", [
    ("cgraph", 2, 1, _prefill_chunk_in_flight, {"max_num_batched_tokens": 32}),
    ("direct", 3, 0, _prefill_chunk_in_flight, {"max_num_batched_tokens": 32}),
    ("direct", 1, 0, _decode_round_in_flight, {"num_decode_steps": 4}),
    ("cgraph", 1, 0, _decode_round_in_flight, {"num_decode_steps": 4}),
], ids=["cgraph-pp2-prefill-chunk", "direct-pp3-prefill-chunk", "direct-pp1-decode-round",
        "cgraph-pp1-decode-round"])
def test_a_death_at_any_point_loses_no_request(ray_cluster, tiny_llama, plane, pp, stage, ready,
                                               options):
    with LLM(str(tiny_llama), pipeline_parallel_size=pp, control_plane=plane,
             max_model_len=256, **options) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [70, 9, 40, 5])
        killer = _KillOnce(stage, ready)
        outs = _drive(llm.engine, prompts, GREEDY, killer)
        assert killer.fired, "the kill point never came"
        assert outs == hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
        assert llm.engine.restarts == 1 and llm.engine.recovery.requeued >= 1
        if pp == 1:
            assert llm.engine.stats.rounds_ahead > 0  # asynchronous rounds were in use


def test_a_death_while_a_result_is_read(ray_cluster, tiny_llama):
    """Stage 1 takes 4 s longer over step 6 (its progress advancing, so no timeout); stage 0
    is killed a second into that wait: the driver, reading step 6's result, sees the death
    and every request completes on new workers."""
    with LLM(str(tiny_llama), pipeline_parallel_size=2, fault_inject="slow:1:6:4",
             step_timeout_s=3) as llm:
        engine = llm.engine
        prompts = corpus_prompts(llm.get_tokenizer(), [6, 11, 8])
        killed: list[float] = []

        def kill_while_waiting() -> None:
            deadline = time.monotonic() + 120
            while engine.stats.steps < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.0)  # step 6 is in flight, its stage 1 slowed for 4 s
            killed.append(time.monotonic())
            ray.kill(engine.executor.all_workers[0], no_restart=True)

        thread = threading.Thread(target=kill_while_waiting, daemon=True)
        thread.start()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        thread.join()
        assert killed
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 24)
        assert engine.restarts == 1


def test_poison_request_fails_after_two_deaths_and_the_rest_complete(ray_cluster, tiny_llama):
    """One prompt holds a token that makes stage 0's process exit whenever it is computed.
    It is failed, named, after two deaths; every other request completes exactly."""
    short = SamplingParams(temperature=0, max_tokens=12)
    vocab = transformers.AutoConfig.from_pretrained(tiny_llama).vocab_size
    prompts = corpus_prompts(load_tokenizer(str(tiny_llama)), [5, 9, 7, 12, 6])
    expected = hf_greedy(tiny_llama, prompts, short.max_tokens)
    seen = {t for ids in prompts + expected for t in ids}
    poison = next(t for t in range(vocab - 1, 0, -1) if t not in seen)
    batch = prompts[:2] + [prompts[2] + [poison]] + prompts[3:]
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_restarts=3,
             fault_inject=f"poison:0:{poison}") as llm:
        with pytest.raises(RequestFailedError) as err:
            llm.generate([{"prompt_token_ids": p} for p in batch], short, use_tqdm=False)
        failure = err.value
        assert list(failure.errors) == [2]
        out = failure.outputs[2]
        assert out.error_kind is ErrorKind.POISON_REQUEST and not out.error_kind.retryable
        assert f"request {out.request_id!r} was in flight at 2 pipeline failures" in out.error
        others = [o.outputs[0].token_ids for i, o in enumerate(failure.outputs) if i != 2]
        assert others == expected[:2] + expected[3:]
        assert llm.engine.restarts == 2 and llm.is_healthy()


# -- the strike rules, on plain Python --------------------------------------------------------
def _request(request_id: str) -> Request:
    params = SamplingParams(max_tokens=8)
    seq = Sequence(0, request_id, 0, [1, 2], params, seed=0)
    return Request(request_id, None, [1, 2], params, [seq])


def test_quarantine_releases_suspects_one_at_a_time_and_blames_a_repeat():
    a, b, c = _request("a"), _request("b"), _request("c")
    live = {r.request_id: r for r in (a, b, c)}
    q = Quarantine(limit=2)
    assert q.on_failure([a, b]) == []  # both suspects now, held
    assert q.release(live) is a and q.release(live) is None  # b waits while a is on trial
    a.seqs[0].output_token_ids.append(5)  # a produced a token: cleared
    assert q.release(live) is b and not q.is_suspect("a")
    # a failure while b is on trial (c, not a suspect, runs beside it): b is blamed
    assert q.on_failure([b, c]) == [b]
    assert q.is_suspect("c") and q.strikes["c"] == 1
    del live["b"]
    assert q.release(live) is c


def test_quarantine_keeps_held_suspects_through_a_failure_they_missed():
    a, b = _request("a"), _request("b")
    live = {"a": a, "b": b}
    q = Quarantine(limit=2)
    q.on_failure([a, b])
    assert q.release(live) is a
    assert q.on_failure([a]) == [a]  # a on trial again at a failure: its second in a row
    assert q.strikes == {"b": 1}  # b was held, not in flight: not blamed
    assert q.release(live) is b


def test_quarantine_limit_one_fails_at_once_and_rejects_zero():
    a = _request("a")
    assert Quarantine(limit=1).on_failure([a, a]) == [a]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        Quarantine(limit=0)


def test_max_failures_per_request_must_be_a_positive_integer():
    from raypp.config import RuntimeConfig

    assert RuntimeConfig().max_failures_per_request == 2
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_failures_per_request must be an integer >= 1"):
            RuntimeConfig(max_failures_per_request=bad)
