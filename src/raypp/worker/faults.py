"""Test-only fault injection, off unless ``RuntimeConfig.fault_inject`` is set.

Forms: ``raise:<stage>:<step>`` raises inside stage ``<stage>`` at step id
``<step>``; ``sleep:<stage>:<step>:<seconds>`` stalls it there;
``delay_send:<stage>:<seconds>`` sleeps after each tensor the stage sends to the
next stage (between Ray's tensor send and its CPU-data write on the compiled graph).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

_KINDS = ("raise", "sleep", "delay_send")


@dataclass
class FaultInjector:
    kind: str | None = None
    step: int = -1
    seconds: float = 0.0

    @staticmethod
    def parse(spec: str) -> tuple[str, int, int, float]:
        """``(kind, stage, step, seconds)``; ``ValueError`` naming the forms if malformed."""
        parts = spec.split(":")
        try:
            kind = parts[0]
            if kind not in _KINDS or len(parts) < 3:
                raise ValueError
            if kind == "delay_send":
                return kind, int(parts[1]), -1, float(parts[2])
            return kind, int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0
        except (ValueError, IndexError):
            raise ValueError(
                f"fault_inject={spec!r} is malformed: expected 'raise:<stage>:<step>', "
                "'sleep:<stage>:<step>:<seconds>' or 'delay_send:<stage>:<seconds>'"
            ) from None

    @classmethod
    def for_stage(cls, spec: str | None, stage: int) -> FaultInjector:
        """The injector of pipeline stage ``stage`` (inert unless ``spec`` targets it)."""
        if not spec:
            return cls()
        kind, target, step, seconds = cls.parse(spec)
        return cls(kind, step, seconds) if target == stage else cls()

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
