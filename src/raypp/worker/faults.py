"""Test-only fault injection, off unless ``RuntimeConfig.fault_inject`` is set.

The spec's grammar is :mod:`raypp.fault_spec`; here a stage acts on it: ``raise``,
``sleep`` and ``poison`` before the targeted step, ``slow`` inside its forward (at the
forward's first progress tick), ``delay_send`` after each tensor the stage sends to
the next stage (between Ray's tensor send and its CPU-data write on the compiled graph).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from raypp.fault_spec import FaultSpec
from raypp.step import StepInput
from raypp.worker.progress import StepProgress

_SLOW_SLICE_S = 0.1  # a slow forward advances its progress this often


@dataclass
class FaultInjector:
    kind: str | None = None
    step: int = -1
    seconds: float = 0.0
    token: int = -1
    _slowed: bool = False

    @classmethod
    def for_stage(cls, spec: str | None, stage: int) -> FaultInjector:
        """The injector of pipeline stage ``stage`` (inert unless ``spec`` targets it)."""
        if not spec:
            return cls()
        fault = FaultSpec.parse(spec)
        if fault.stage != stage:
            return cls()
        return cls(fault.kind, fault.step, fault.seconds, fault.token)

    def before_step(self, step: StepInput) -> None:
        if self.kind == "raise" and step.step_id == self.step:
            raise RuntimeError(f"injected fault at step {step.step_id}")
        if self.kind == "sleep" and step.step_id == self.step:
            time.sleep(self.seconds)
        if self.kind == "poison" and self.token in step.input_ids:
            os._exit(1)  # as a crash would: no clean-up, no exception to report

    @property
    def in_forward(self) -> bool:
        """True if :meth:`on_progress` has anything to do."""
        return self.kind == "slow"

    def on_progress(self, progress: StepProgress) -> None:
        """``slow``: at the targeted step's first progress tick, take ``seconds`` longer,
        ticking ``progress`` every 0.1 s."""
        if self.kind != "slow" or self._slowed or progress.step_id != self.step:
            return
        self._slowed = True
        deadline = time.monotonic() + self.seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_SLOW_SLICE_S, left))
            progress.tick()

    @property
    def delays_sends(self) -> bool:
        return self.kind == "delay_send"

    def after_send(self) -> None:
        if self.kind == "delay_send":
            time.sleep(self.seconds)
