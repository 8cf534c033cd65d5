"""What the engine needs from an executor, and the one place that picks one.

Two control planes drive the same stage actors and the same PP communicator:

- ``cgraph`` (:class:`~raypp.executor.ray_executor.RayExecutor`, the default): a Ray
  compiled graph; PP tensors ride ``RayPPCommunicator`` over the PP group.
- ``direct`` (:class:`~raypp.executor.direct_executor.DirectExecutor`): a loop in
  each stage takes step descriptors from a ZeroMQ queue and moves PP tensors with
  the PP group's ``send_tensor_dict`` / ``recv_tensor_dict``; Ray only places and
  supervises the actors.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from raypp import envs
from raypp.config import EngineConfig
from raypp.engine.step import StepInput, StepOutput

CONTROL_PLANES = ("cgraph", "direct")


@runtime_checkable
class Executor(Protocol):
    """Runs micro-batches through the stages; results come back in any order asked.

    ``submit`` returns at once with a handle; up to ``max_inflight`` steps may be
    in flight. ``result(handle, timeout)`` returns that step's :class:`StepOutput`,
    raises the stage's error (naming the stage) if it failed there, or raises
    within ``timeout`` seconds if no result came; a dead stage raises promptly.
    """

    control_plane: str
    namespace: str
    num_kv_blocks: int
    workers: list[list[Any]]

    def submit(self, step: StepInput) -> Any: ...

    def result(self, handle: Any, timeout: float | None = None) -> StepOutput: ...

    def check_health(self, timeout: float = 5.0) -> bool: ...

    def comm_stats(self) -> list[dict[str, Any]]: ...

    def traced_intervals(self) -> list[tuple[int, float, float]]: ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig, control_plane: str | None = None) -> Executor:
    """Start the executor of ``control_plane`` (default: ``RAYPP_CONTROL_PLANE``).

    Raises ``ValueError`` naming the choices for an unknown plane.
    """
    plane = (control_plane or envs.RAYPP_CONTROL_PLANE or "cgraph").strip().lower()
    if plane == "cgraph":
        from raypp.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if plane == "direct":
        from raypp.executor.direct_executor import DirectExecutor

        return DirectExecutor(config)
    raise ValueError(f"control plane must be one of {', '.join(CONTROL_PLANES)}, got {plane!r}")
