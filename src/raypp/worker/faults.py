"""Test-only fault injection, off unless ``RuntimeConfig.fault_inject`` is set.

The spec's grammar is :mod:`raypp.fault_spec`; here a stage acts on it: ``raise`` and
``sleep`` before the targeted step, ``delay_send`` after each tensor the stage sends to
the next stage (between Ray's tensor send and its CPU-data write on the compiled graph).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from raypp.fault_spec import FaultSpec


@dataclass
class FaultInjector:
    kind: str | None = None
    step: int = -1
    seconds: float = 0.0

    @classmethod
    def for_stage(cls, spec: str | None, stage: int) -> FaultInjector:
        """The injector of pipeline stage ``stage`` (inert unless ``spec`` targets it)."""
        if not spec:
            return cls()
        fault = FaultSpec.parse(spec)
        return cls(fault.kind, fault.step, fault.seconds) if fault.stage == stage else cls()

    def before_step(self, step_id: int) -> None:
        if self.kind == "raise" and step_id == self.step:
            raise RuntimeError(f"injected fault at step {step_id}")
        if self.kind == "sleep" and step_id == self.step:
            time.sleep(self.seconds)

    @property
    def delays_sends(self) -> bool:
        return self.kind == "delay_send"

    def after_send(self) -> None:
        if self.kind == "delay_send":
            time.sleep(self.seconds)
