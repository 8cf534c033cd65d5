"""Driving ``LLMEngine.step()`` by hand and timing every step.

:class:`StepRecorder` wraps an executor's ``submit`` and ``result`` (handing a
micro-batch to the stages; blocking for its sampled tokens). :func:`drive` runs a
list of requests to completion through ``engine.step()`` and returns a
:class:`RunStats`: whole-run times, per-request TTFT/TPOT/end-to-end times, one
:class:`StepTime` per engine step, and each request's generated token ids.

Per engine step, ``engine overhead = step wall time - time blocked in result``:
scheduling, step-descriptor building, submission and post-processing (appending
tokens, detokenizing, stop checks) on the driver.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from raypp.bench.workload import BenchRequest


@dataclass
class _Submit:
    step_id: int
    start: float
    end: float
    num_tokens: int
    num_seqs: int
    traced: bool
    num_steps: int = 1


@dataclass
class _Wait:
    step_id: int
    start: float
    end: float


class StepRecorder:
    """Times an executor's ``submit`` and ``result`` calls until :meth:`close`.

    Wraps the bound methods on the instance (the class is untouched), so the
    engine runs its normal code path. ``submits`` and ``waits`` hold one entry per
    call, in call order, with ``time.time()`` stamps.
    """

    def __init__(self, executor: Any):
        self.executor = executor
        self.submits: list[_Submit] = []
        self.waits: list[_Wait] = []
        self._submit, self._result = executor.submit, executor.result
        executor.submit, executor.result = self.submit, self.result

    def submit(self, step: Any) -> Any:
        start = time.time()
        handle = self._submit(step)
        self.submits.append(_Submit(step.step_id, start, time.time(), step.num_tokens,
                                    step.num_seqs, bool(step.trace),
                                    getattr(step, "num_steps", 1)))
        return handle

    def result(self, handle: Any, timeout: float | None = None) -> Any:
        start = time.time()
        out = self._result(handle, timeout)
        self.waits.append(_Wait(out.step_id, start, time.time()))
        return out

    def clear(self) -> None:
        self.submits, self.waits = [], []

    def close(self) -> None:
        for name in ("submit", "result"):
            if name in vars(self.executor):
                delattr(self.executor, name)


@dataclass
class StepTime:
    """One ``engine.step()`` call.

    ``wall_s``: the call's wall time. ``micro_batch_s``: from submitting the
    micro-batch this call read to its result arriving (its time in the pipeline), or
    ``None`` when the call read none. ``prefill``: that micro-batch computed prompt
    tokens (it had more tokens than sequences; a chunked-prefill batch that also decodes
    counts as prefill); a decode micro-batch has one token per sequence and runs
    ``decode_steps`` decode steps.
    """

    index: int
    wall_s: float
    micro_batch_s: float | None = None
    num_tokens: int = 0
    num_seqs: int = 0
    decode_steps: int = 1

    @property
    def prefill(self) -> bool:
        return self.micro_batch_s is not None and self.num_tokens > self.num_seqs

    @property
    def kind(self) -> str:
        """``"prefill"``, ``"decode"`` or ``"idle"`` (the call read no micro-batch)."""
        if self.micro_batch_s is None:
            return "idle"
        return "prefill" if self.prefill else "decode"


@dataclass
class RunStats:
    """What one pass over a list of requests measured on the driver.

    ``ttft_s``, ``tpot_s`` and ``e2e_s`` are in completion order; ``output_token_ids``
    maps a request's index in the list passed to :func:`drive` to its generated ids.
    """

    elapsed_s: float = 0.0
    steps: int = 0
    step_wall_s: float = 0.0
    wait_s: float = 0.0
    submit_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    step_times: list[StepTime] = field(default_factory=list)
    output_token_ids: dict[int, list[int]] = field(default_factory=dict)

    def add(self, other: RunStats) -> None:
        """Accumulate ``other`` (a later pass) into this one."""
        for name in ("elapsed_s", "steps", "step_wall_s", "wait_s", "submit_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttft_s += other.ttft_s
        self.tpot_s += other.tpot_s
        self.e2e_s += other.e2e_s
        self.step_times += other.step_times


def _step_time(recorder: StepRecorder, index: int, wall_s: float, waits_before: int,
               submits: dict[int, _Submit]) -> StepTime:
    st = StepTime(index, wall_s)
    if len(recorder.waits) > waits_before:
        wait = recorder.waits[-1]
        sub = submits.get(wait.step_id)
        if sub is not None:
            st.micro_batch_s = wait.end - sub.start
            st.num_tokens, st.num_seqs, st.decode_steps = sub.num_tokens, sub.num_seqs, sub.num_steps
    return st


def drive(engine: Any, recorder: StepRecorder, requests: list[BenchRequest], concurrency: int,
          bar: tqdm | None = None, prefix: str = "bench") -> RunStats:
    """Run ``requests`` to completion keeping at most ``concurrency`` of them in the engine.

    TTFT, TPOT and end-to-end times come from the engine's own request times (arrival,
    first token), so they are right whether or not the engine emits unfinished requests.
    ``bar`` advances by one per finished request.
    """
    stats = RunStats()
    pending = deque(enumerate(requests))
    added: dict[str, tuple[int, BenchRequest]] = {}
    active = 0
    waits_before = len(recorder.waits)
    submits_before = len(recorder.submits)
    submits: dict[int, _Submit] = {}  # step id -> its submit, for the step that reads it
    seen = submits_before
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and active < concurrency:
            i, req = pending.popleft()
            rid = f"{prefix}-{i}"
            engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids},
                               req.sampling_params())
            added[rid] = (i, req)
            active += 1
        waits_at_step = len(recorder.waits)
        step_start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - step_start
        stats.step_wall_s += wall
        submits.update((s.step_id, s) for s in recorder.submits[seen:])
        seen = len(recorder.submits)
        stats.step_times.append(_step_time(recorder, len(stats.step_times), wall, waits_at_step,
                                           submits))
        now = time.monotonic()  # the clock of the engine's request times
        for out in outputs:
            if out.finished:
                active -= 1
                i, req = added[out.request_id]
                arrival = out.metrics["arrival_time"]
                first = out.metrics.get("first_token_time", now)
                stats.ttft_s.append(first - arrival)
                stats.e2e_s.append(now - arrival)
                if req.output_len > 1:
                    stats.tpot_s.append((now - first) / (req.output_len - 1))
                if out.outputs:
                    stats.output_token_ids[i] = list(out.outputs[0].token_ids)
                if bar is not None:
                    bar.update(1)
    stats.elapsed_s = time.perf_counter() - started
    waits = recorder.waits[waits_before:]
    stats.steps = len(waits)
    stats.wait_s = sum(w.end - w.start for w in waits)
    stats.submit_s = sum(s.end - s.start for s in recorder.submits[submits_before:])
    return stats
