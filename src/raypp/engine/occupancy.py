"""Each stage's occupancy over a window, and the engine's periodic log line.

From two readings of a stage's counters (:mod:`raypp.worker.occupancy`), over the
window ``W`` between them: ``busy`` = compute time / W; ``bubble`` = time waiting for
the input of a step already submitted / W (the pipeline's fill and drain, and a stage
waiting on a slower one); ``idle`` = 1 - busy (bubble included: every moment not
computing); ``mean_wait_s`` = waiting time per step; ``tokens_per_step``.

:class:`OccupancyMonitor` reads the stages every ``interval_s`` while the engine has
requests, keeps the latest window per stage (Prometheus and ``EngineStats`` report it)
and logs one INFO line per window; when a stage was idle more than
``STARVED_IDLE`` of a window during which requests were in the engine the whole time,
it says so and what to change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from raypp.worker.occupancy import OccupancyTotals

logger = logging.getLogger(__name__)

STARVED_IDLE = 0.25


@dataclass(frozen=True)
class StageWindow:
    """One stage over one window (module docstring)."""

    stage: int
    seconds: float
    busy: float
    bubble: float
    mean_wait_s: float
    tokens_per_step: float
    steps: int

    @property
    def idle(self) -> float:
        return max(0.0, 1.0 - self.busy)

    @classmethod
    def between(cls, before: OccupancyTotals, after: OccupancyTotals) -> StageWindow:
        seconds = max(after.at - before.at, 1e-9)
        steps = after.steps - before.steps
        wait = after.wait_s - before.wait_s
        return cls(after.stage, seconds, min(1.0, (after.busy_s - before.busy_s) / seconds),
                   min(1.0, wait / seconds), wait / steps if steps else 0.0,
                   (after.tokens - before.tokens) / steps if steps else 0.0, steps)

    def as_dict(self) -> dict[str, float]:
        return {"stage": self.stage, "busy": round(self.busy, 4), "idle": round(self.idle, 4),
                "bubble": round(self.bubble, 4), "mean_wait_ms": round(self.mean_wait_s * 1e3, 3),
                "tokens_per_step": round(self.tokens_per_step, 2), "steps": self.steps}


def windows(before: list[OccupancyTotals], after: list[OccupancyTotals]) -> list[StageWindow]:
    """Per stage, the window between two readings of every stage."""
    return [StageWindow.between(b, a) for b, a in zip(before, after, strict=True)]


def starved_message(stages: list[StageWindow]) -> str | None:
    """The advice for the most idle stage if it was idle more than ``STARVED_IDLE``."""
    worst = max(stages, key=lambda w: w.idle, default=None)
    if worst is None or worst.idle <= STARVED_IDLE:
        return None
    return (f"stage {worst.stage} idle {worst.idle:.0%} (waiting for input {worst.bubble:.0%}) "
            "while requests were in the engine: pipeline starved — raise max_num_seqs or use "
            "fewer stages")


class OccupancyMonitor:
    """Windows of stage occupancy, every ``interval_s`` while requests are in the engine.

    ``read`` returns every stage's current totals (raises if a stage does not answer;
    that window is skipped). :meth:`tick` is the engine's per-step call; it reads only
    when a window is due.
    """

    def __init__(self, read: Callable[[], list[OccupancyTotals]], interval_s: float = 10.0):
        self.read = read
        self.interval_s = interval_s
        self.latest: list[StageWindow] = []
        self._start: list[OccupancyTotals] | None = None
        self._due = 0.0

    def tick(self, has_requests: bool, summary: Callable[[], str] = str) -> None:
        """Called once per engine step; ``has_requests``: the engine holds unfinished
        requests now. ``summary()``: the engine's own part of the log line."""
        now = time.monotonic()
        if not has_requests:
            self._start = None  # a window counts only time with requests throughout
            return
        if self._start is not None and now < self._due:
            return
        try:
            totals = self.read()
        except Exception as e:  # noqa: BLE001 - a report, not a requirement
            logger.debug("stage occupancy not read: %s", e)
            self._start = None
            return
        if self._start is not None:
            self.latest = windows(self._start, totals)
            busy = " ".join(f"{w.busy:.0%}" for w in self.latest)
            logger.info("%s; stages busy %s", summary() or "engine", busy)
            advice = starved_message(self.latest)
            if advice:
                logger.info("%s", advice)
        self._start, self._due = totals, now + self.interval_s

    def reset(self) -> None:
        """Forget the window in progress (the stages were replaced: their counters restart)."""
        self._start = None
