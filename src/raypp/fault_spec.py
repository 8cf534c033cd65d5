"""The grammar of ``RuntimeConfig.fault_inject`` (test-only fault injection).

Driver-neutral, so :mod:`raypp.config` rejects a malformed spec when the config is made
and the stage (:mod:`raypp.worker.faults`) acts on the same parse. Forms:
``raise:<stage>:<step>`` raises inside stage ``<stage>`` at step id ``<step>``;
``sleep:<stage>:<step>:<seconds>`` stalls it there; ``delay_send:<stage>:<seconds>``
sleeps after each tensor the stage sends to the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("raise", "sleep", "delay_send")


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of KINDS
    stage: int  # the pipeline stage it targets
    step: int = -1  # the step id it fires at (-1: every send, for delay_send)
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """``ValueError`` naming the forms if ``spec`` is malformed."""
        parts = spec.split(":")
        try:
            kind = parts[0]
            if kind not in KINDS or len(parts) < 3:
                raise ValueError
            if kind == "delay_send":
                return cls(kind, int(parts[1]), -1, float(parts[2]))
            return cls(kind, int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0)
        except (ValueError, IndexError):
            raise ValueError(
                f"fault_inject={spec!r} is malformed: expected 'raise:<stage>:<step>', "
                "'sleep:<stage>:<step>:<seconds>' or 'delay_send:<stage>:<seconds>'"
            ) from None
