"""What one stage did with its time, counted always (two clock reads per step).

Per stage, cumulative since start-up: ``busy_s`` (computing steps), ``wait_s`` (free,
with a step already submitted by the driver, waiting for that step's input to arrive:
for stage 0 the descriptor's trip, for a later stage mostly the earlier stages' compute
of that micro-batch), ``steps`` and ``tokens`` (fed tokens, decode rounds counting each
step). The rest of the wall time the stage was idle with no step submitted to it: the
driver did not have one to give (starved). Times are wall-clock (``time.time``): the
driver's submission time and the stage's clock are compared, so across hosts a clock
offset shifts ``wait_s`` (it never goes below zero per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class OccupancyTotals:
    """One reading of a stage's counters; ``at`` is when it was taken (wall clock)."""

    stage: int
    at: float
    busy_s: float
    wait_s: float
    steps: int
    tokens: int


class StageOccupancy:
    """The counters of one stage. :meth:`record` runs on the stage's step thread,
    :meth:`totals` on any other: the counters are one tuple, replaced whole."""

    def __init__(self, stage: int):
        self.stage = stage
        # busy_s, wait_s, steps, tokens, end of the last step
        self._counts = (0.0, 0.0, 0, 0, time.time())

    def record(self, submitted_at: float, started: float, ended: float, tokens: int) -> None:
        """One step computed from ``started`` to ``ended``; the driver submitted it at
        ``submitted_at`` (0: unknown, no wait counted)."""
        busy, wait, steps, total, last_end = self._counts
        if submitted_at > 0:
            wait += max(0.0, started - max(last_end, submitted_at))
        self._counts = (busy + ended - started, wait, steps + 1, total + tokens, ended)

    def totals(self) -> OccupancyTotals:
        busy, wait, steps, tokens, _ = self._counts
        return OccupancyTotals(self.stage, time.time(), busy, wait, steps, tokens)
