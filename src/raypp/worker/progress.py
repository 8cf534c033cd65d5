"""A stage's progress while it computes, readable while it computes.

The forward advances a counter as it goes (each layer's attention, and each block of
queries of a long prompt's attention: :class:`~raypp.model.attention.AttentionMetadata`
carries :meth:`StepProgress.tick`); the worker marks when a step starts and ends.
The liveness probe (``StageWorker.progress``, answered on another thread of the
actor while a step runs) reads a :class:`StageProgress` snapshot without waiting for
the step. The driver (:mod:`raypp.executor.liveness`) declares a stage stuck only
when no counter moves for the step timeout, never because a step is long.

One thread computes at a time on a stage (steps run in submission order), so the
counter has one writer; readers see a value at least as new as the last layer done.
On CUDA the counter follows kernel launches, not their completion: a forward whose
launches are all queued waits at its first host sync without ticking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StageProgress:
    """One stage worker's progress as its probe saw it (what crosses to the driver)."""

    count: int  # units of work done since the worker started; only grows
    step_id: int | None  # the step being computed, None between steps
    busy_s: float  # how long the current step has run (0.0 between steps)


class StepProgress:
    """The counter one stage's compute advances and its liveness probe reads."""

    def __init__(self) -> None:
        self._count = 0
        self._step_id: int | None = None
        self._started = 0.0

    def tick(self) -> None:
        """One more unit of work done (a layer, a block of attention, a step)."""
        self._count += 1

    @property
    def step_id(self) -> int | None:
        """The step being computed (``None`` between steps)."""
        return self._step_id

    def begin(self, step_id: int) -> None:
        self._step_id, self._started = step_id, time.monotonic()
        self.tick()

    def end(self) -> None:
        self._step_id = None
        self.tick()

    def snapshot(self) -> StageProgress:
        step_id = self._step_id
        busy = time.monotonic() - self._started if step_id is not None else 0.0
        return StageProgress(self._count, step_id, busy)
