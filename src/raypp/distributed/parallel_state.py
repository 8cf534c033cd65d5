"""The one place that builds and owns every process group of a worker.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``. TP groups are contiguous
ranks of one stage; there is one PP group ("lane") per TP index, e.g. world 4
with tp=2, pp=2 gives TP groups [0,1], [2,3] and PP groups [0,2], [1,3].
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from raypp.distributed.communicator import GroupCoordinator


@dataclass(frozen=True)
class RankLayout:
    """Where a global rank sits in the TP × PP grid."""

    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, tp_rank)`` of a global rank."""
        return divmod(rank, self.tp_size)

    def tp_group_ranks(self) -> list[list[int]]:
        return [[self.rank(p, t) for t in range(self.tp_size)] for p in range(self.pp_size)]

    def pp_group_ranks(self) -> list[list[int]]:
        return [[self.rank(p, t) for p in range(self.pp_size)] for t in range(self.tp_size)]


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def init_distributed(
    layout: RankLayout, rank: int, init_method: str, device: torch.device, timeout_s: float,
    use_local_pipes: bool = True,
) -> None:
    """Join the world and build the world, TP and PP groups of this worker.

    ``use_local_pipes`` (CPU): same-host ranks exchange tensors over shared-memory
    pipes (:mod:`raypp.distributed.local_pipes`) instead of gloo.
    """
    global _WORLD, _TP, _PP
    # the default group only rendezvouses; each group makes its own device group, so two
    # ranks sharing a GPU never build an NCCL communicator they cannot have
    dist.init_process_group(
        backend="gloo",
        init_method=init_method,
        rank=rank,
        world_size=layout.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    pipes = use_local_pipes
    _WORLD = GroupCoordinator.build("world", list(range(layout.world_size)), device, timeout_s,
                                    pipes)
    # new_group is collective over the world: every rank builds every group, in order.
    for ranks in layout.tp_group_ranks():
        _TP = GroupCoordinator.build("tp", ranks, device, timeout_s, pipes) or _TP
    for ranks in layout.pp_group_ranks():
        _PP = GroupCoordinator.build("pp", ranks, device, timeout_s, pipes) or _PP


def get_world_group() -> GroupCoordinator:
    assert _WORLD is not None, "distributed state is not initialized"
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor-parallel group is not initialized"
    return _TP


def get_pp_group() -> GroupCoordinator:
    assert _PP is not None, "pipeline-parallel group is not initialized"
    return _PP


def is_initialized() -> bool:
    return _WORLD is not None


def destroy_distributed() -> None:
    """Tear down every group of this worker (safe to call when none exist)."""
    global _WORLD, _TP, _PP
    for group in (_PP, _TP, _WORLD):
        if group is not None:
            group.destroy()
    _WORLD = _TP = _PP = None
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()
