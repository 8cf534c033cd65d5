"""Stuck means no progress, not slow: the watch a driver keeps while it waits for a step.

A control plane waits for a step's result in short slices; between slices it asks a
:class:`ProgressWatch` whether the stages still move. The watch reads every stage's
progress counter (:class:`~raypp.worker.progress.StageProgress`, advanced by each
layer and each block of a long attention, answered on another thread of the stage
actor while the step computes) at most once per ``interval_s``, and reports the
pipeline stalled once no counter has moved for ``timeout_s`` since the first probe
(made ``interval_s`` into the wait, so a step that ends sooner costs no probe). A long step (a
long prompt's prefill at any accepted ``max_model_len``, a slow CPU) keeps its
counters moving and is waited for; a stage blocked in a collective, or waiting on
a peer that will never send, freezes them and is declared stuck within
``timeout_s`` plus two probe intervals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from raypp.worker.progress import StageProgress

PROBE_INTERVAL_S = 1.0  # how often a long wait reads the stages' progress
PROBE_TIMEOUT_S = 2.0  # a live stage answers its probe well within this while computing

Probe = Callable[[float], Sequence[StageProgress | None]]  # None: no answer in time


class ProgressWatch:
    """Watches one wait for a step result. ``probe(timeout)`` reads every stage's
    progress (``None`` for a stage that did not answer); ``names[i]`` names stage
    worker ``i`` in messages."""

    def __init__(self, probe: Probe, names: Sequence[str], timeout_s: float,
                 interval_s: float = PROBE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._probe, self._names = probe, list(names)
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._clock = clock
        self._last_probe = clock()  # the wait's start: the first probe is interval_s later
        self._last_move: float | None = None  # set by the first probe (the baseline)
        self._seen: list[StageProgress | None] = []

    def stalled(self) -> bool:
        """True once no stage's counter has moved for ``timeout_s``; decided only on a
        fresh probe (one per ``interval_s``), so calls in between are cheap and False."""
        if self._clock() - self._last_probe < self.interval_s:
            return False
        self._read()
        assert self._last_move is not None
        return self._clock() - self._last_move >= self.timeout_s

    def _read(self) -> None:
        seen = list(self._probe(min(PROBE_TIMEOUT_S, self.interval_s * 2)))
        now = self._last_probe = self._clock()
        if self._last_move is None or any(
                a is not None and b is not None and a.count != b.count
                for a, b in zip(self._seen, seen)):
            self._last_move = now
        # a stage that missed one probe keeps its last answer, so its next one compares
        self._seen = [s if s is not None else old
                      for s, old in zip(seen, self._seen or [None] * len(seen))]

    def describe(self) -> str:
        """Which stages are frozen inside a step, or why none is (for the error)."""
        waited = self._clock() - (self._last_move or self._last_probe)
        inside = [f"{self._names[i]} inside step {p.step_id} for {p.busy_s:.1f} s"
                  for i, p in enumerate(self._seen) if p is not None and p.step_id is not None]
        silent = [self._names[i] for i, p in enumerate(self._seen) if p is None]
        if inside:
            what = "; ".join(inside)
        else:
            what = "no stage is inside a step (they wait on a transfer or a queue)"
        if silent:
            what += f"; no progress report from {', '.join(silent)}"
        return f"no stage made progress for {waited:.1f} s: {what}"
