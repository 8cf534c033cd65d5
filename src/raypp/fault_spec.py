"""The grammar of ``RuntimeConfig.fault_inject`` (test-only fault injection).

Driver-neutral, so :mod:`raypp.config` rejects a malformed spec when the config is made
and the stage (:mod:`raypp.worker.faults`) acts on the same parse. Forms:

- ``raise:<stage>:<step>``: stage ``<stage>`` raises at step id ``<step>``;
- ``sleep:<stage>:<step>:<seconds>``: it blocks there for ``<seconds>`` before the
  forward, its progress frozen (as a stage stuck in a collective whose peer never comes);
- ``slow:<stage>:<step>:<seconds>``: it takes ``<seconds>`` longer inside the forward of
  that step, advancing its progress as it goes (a long step, not a stuck one);
- ``delay_send:<stage>:<seconds>``: it sleeps after each tensor it sends to the next stage;
- ``poison:<stage>:<token>``: its process exits at once (as on a crash) whenever a step
  it runs feeds token id ``<token>``: a request whose prompt holds it kills the stage
  every time it is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("raise", "sleep", "slow", "delay_send", "poison")


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of KINDS
    stage: int  # the pipeline stage it targets
    step: int = -1  # the step id it fires at (-1: any step, for delay_send and poison)
    seconds: float = 0.0
    token: int = -1  # poison only: the token id that kills the stage

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
            if kind == "poison":
                return cls(kind, int(parts[1]), token=int(parts[2]))
            if kind in ("sleep", "slow") and len(parts) != 4:
                raise ValueError
            return cls(kind, int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0)
        except (ValueError, IndexError):
            raise ValueError(
                f"fault_inject={spec!r} is malformed: expected 'raise:<stage>:<step>', "
                "'sleep:<stage>:<step>:<seconds>', 'slow:<stage>:<step>:<seconds>', "
                "'delay_send:<stage>:<seconds>' or 'poison:<stage>:<token>'"
            ) from None
