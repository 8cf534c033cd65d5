"""Test-only fault injection, off unless ``RAYPP_FAULT_INJECT`` is set.

Forms: ``raise:<stage>:<step>`` raises inside stage ``<stage>`` at step id
``<step>``; ``sleep:<stage>:<step>:<seconds>`` stalls it there;
``delay_send:<stage>:<seconds>`` sleeps after each tensor the stage sends
through RayPPCommunicator (between Ray's tensor send and its CPU-data write).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from raypp import envs


@dataclass
class FaultInjector:
    kind: str | None = None
    step: int = -1
    seconds: float = 0.0

    @classmethod
    def from_env(cls, stage: int) -> FaultInjector:
        spec = envs.RAYPP_FAULT_INJECT
        if not spec:
            return cls()
        parts = spec.split(":")
        kind = parts[0]
        if kind not in ("raise", "sleep", "delay_send") or len(parts) < 3:
            raise ValueError(f"RAYPP_FAULT_INJECT={spec!r} is malformed")
        if int(parts[1]) != stage:
            return cls()
        if kind == "delay_send":
            return cls(kind, -1, float(parts[2]))
        return cls(kind, int(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0)

    def before_step(self, step_id: int) -> None:
        if self.kind == "raise" and step_id == self.step:
            raise RuntimeError(f"injected fault at step {step_id}")
        if self.kind == "sleep" and step_id == self.step:
            time.sleep(self.seconds)

    def after_send(self) -> None:
        if self.kind == "delay_send":
            time.sleep(self.seconds)
