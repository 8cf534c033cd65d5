"""RayPPCommunicator: Ray Compiled Graph's ``Communicator`` over the engine's PP group.

Ray moves the tensors of an edge annotated
``with_tensor_transport(transport=RayPPCommunicator(...))`` by calling this
object's ``send``/``recv`` inside the stage actors, so stage-to-stage traffic
rides the PP group's own device communicator (gloo on CPU, NCCL on CUDA) and Ray
creates no second communicator.

How it is registered, and why: the instance is passed to
``with_tensor_transport(transport=...)`` on every PP edge. Ray's other route,
``register_accelerator_context`` + ``transport="accelerator"``, makes Ray build
the communicator itself from a class and rejects actors without an accelerator,
so it cannot serve CPU stages; the instance route serves CPU and CUDA alike.
It subclasses ``CPUCommunicator`` because Ray 2.60 lets only that subclass skip
its "actor has an accelerator" check; every method is overridden.

Ranks are the PP group's ranks, never Ray's: Ray asks ``get_rank`` on the driver
before ``initialize`` (answered from handle order, which the executor makes equal
to PP rank order) and inside actors afterwards (answered from an actor-id → rank
map all-gathered over the PP group).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import ray
import torch
from ray.exceptions import RayChannelError
from ray.experimental.channel.cpu_communicator import CPUCommunicator

TRANSPORT_NAME = "accelerator"  # Ray 2.60 accepts only this for a custom communicator
_ACTOR_ID_BYTES = 32  # hex actor ids: 16 bytes → 32 characters


class RayPPCommunicator(CPUCommunicator):
    """Delegates Ray's point-to-point calls to the PP group's device communicator.

    ``destroy()`` only marks this wrapper closed; the engine owns and keeps the
    group. ``send``/``recv`` after ``destroy`` raise ``RayChannelError``.
    """

    def __init__(self, actor_handles: list[ray.actor.ActorHandle]):
        # CPUCommunicator.__init__ is deliberately not called: it allocates Ray's own state.
        self._actor_handles = list(actor_handles)
        self._world_size = len(self._actor_handles)
        self._rank: int | None = None
        self._actor_id_to_rank: dict[str, int] | None = None
        self._closed = False
        self._group: Any = None

    # -- set-up, inside each stage actor --------------------------------------------
    def initialize(self, rank: int) -> None:
        """Bind to this actor's PP group; Ray's ``rank`` argument is ignored."""
        from raypp.distributed import parallel_state

        self._group = parallel_state.get_pp_group()
        if self._group.world_size != self._world_size:
            raise ValueError(
                f"RayPPCommunicator spans {self._world_size} actors but the PP group "
                f"has {self._group.world_size} ranks"
            )
        self._rank = self._group.rank_in_group
        self._actor_id_to_rank = self._build_actor_rank_map()
        self._closed = False

    def _build_actor_rank_map(self) -> dict[str, int]:
        # Over the group's gloo CPU group: on CUDA a device-group collective would make
        # NCCL build a communicator that PP point-to-point traffic never needs.
        actor_id = ray.get_runtime_context().get_actor_id()
        assert len(actor_id) == _ACTOR_ID_BYTES, actor_id
        return {aid: rank for rank, aid in enumerate(self._group.all_gather_object(actor_id))}

    # -- identity ---------------------------------------------------------------------
    def get_actor_handles(self) -> list[ray.actor.ActorHandle]:
        return self._actor_handles

    def get_rank(self, actor: ray.actor.ActorHandle) -> int:
        """PP rank of ``actor``; ``ValueError`` for an actor outside the group."""
        actor_id = actor._ray_actor_id.hex()
        if self._actor_id_to_rank is not None:
            if actor_id not in self._actor_id_to_rank:
                raise ValueError(f"actor {actor_id} is not in this PP group")
            return self._actor_id_to_rank[actor_id]
        ids = [a._ray_actor_id.hex() for a in self._actor_handles]
        if actor_id not in ids:
            raise ValueError(f"actor {actor_id} is not in this PP group")
        return ids.index(actor_id)

    def get_self_rank(self) -> int | None:
        return self._rank

    def get_world_size(self) -> int:
        return self._world_size

    def get_transport_name(self) -> str:
        return TRANSPORT_NAME

    @classmethod
    def generate_communicator_id(cls) -> str:
        return uuid.uuid4().hex  # no cupy needed

    # -- data -------------------------------------------------------------------------
    def send(self, buf: torch.Tensor, peer_rank: int) -> None:
        """Returns once ``buf`` may be reused; ``RayChannelError`` if destroyed."""
        self._check_open()
        try:
            self._group.send(buf, peer_rank)
        except RuntimeError as e:
            raise RayChannelError(f"PP send to rank {peer_rank} failed: {e}") from e

    def recv(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        peer_rank: int,
        allocator: Any = None,
    ) -> torch.Tensor:
        """A new tensor from ``peer_rank`` (Ray's allocator is not needed)."""
        self._check_open()
        try:
            tensor = self._group.recv(tuple(shape), dtype, peer_rank)
        except RuntimeError as e:
            raise RayChannelError(f"PP recv from rank {peer_rank} failed: {e}") from e
        if tensor.is_cuda:
            # Ray's contract: the buffer is safe to read from any stream on return.
            torch.cuda.current_stream().synchronize()
        self._check_open()  # the buffer is undefined if the group was torn down meanwhile
        return tensor

    def allgather(self, send_buf: torch.Tensor, recv_buf: torch.Tensor) -> None:
        raise NotImplementedError("RayPPCommunicator carries only point-to-point PP traffic")

    def allreduce(self, send_buf: torch.Tensor, recv_buf: torch.Tensor, op: Any = None) -> None:
        raise NotImplementedError("RayPPCommunicator carries only point-to-point PP traffic")

    def reducescatter(
        self, send_buf: torch.Tensor, recv_buf: torch.Tensor, op: Any = None
    ) -> None:
        raise NotImplementedError("RayPPCommunicator carries only point-to-point PP traffic")

    @property
    def recv_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def send_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def destroy(self) -> None:
        """Idempotent; called by every channel that closes. The group stays alive."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RayChannelError("RayPPCommunicator was destroyed")
        if self._group is None:
            raise RayChannelError("RayPPCommunicator used before initialize()")
