"""Process-group wrappers: one ``GroupCoordinator`` per parallel group per worker.

A group owns two ``torch.distributed`` process groups over the same ranks: a
device group (NCCL on CUDA, gloo on CPU) that moves tensors, and a gloo CPU group
that moves small pickled metadata. Everything that moves tensors between ranks
in raypp goes through a ``GroupCoordinator``; ranks passed to its methods are
ranks *within the group*.

Each point-to-point edge takes the transport that works between where its two ranks
are, chosen once when the group is built (:meth:`DeviceCommunicator.transport`):

- ``"nccl"``: CUDA ranks on different GPUs;
- ``"host-staged"``: CUDA ranks on the *same* GPU (NCCL refuses two ranks on one
  device): the tensor is copied into a shared-memory slot of the group's same-host
  pipes (:mod:`raypp.distributed.local_pipes`) and from there onto the device;
- ``"shm-pipe"``: CPU ranks on the same host; ``"gloo"``: CPU ranks on other hosts.

Collectives of a CUDA group whose ranks share a GPU (tensor parallelism on one GPU)
are staged through host memory over the gloo CPU group (not capturable in CUDA graphs).
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raypp.distributed import local_pipes
from raypp.distributed.local_pipes import LocalPipes

# (op, peer rank in the group, start, end, nbytes) of each traced send/recv in this
# process, wall clock (time.time); filled only by groups built with tracing on.
CommEvent = tuple[str, int, float, float, int]
_COMM_TRACE: deque[CommEvent] = deque(maxlen=1_000_000)


def drain_comm_trace() -> list[CommEvent]:
    """This process's traced send/recv intervals since the last drain (oldest first)."""
    out = list(_COMM_TRACE)
    _COMM_TRACE.clear()
    return out


@dataclass
class TrafficStats:
    """Counts of point-to-point traffic through one device communicator."""

    sends: int = 0
    recvs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class DeviceCommunicator:
    """Tensor transfers over a group's device process group (and its same-host pipes).

    ``send`` returns once the tensor may be reused by the caller (gloo and the pipes
    copy synchronously; NCCL enqueues on the current stream). ``recv`` returns a new
    tensor whose contents are valid on the current stream. A dead peer surfaces
    as ``RuntimeError`` at the latest when the group's timeout expires.
    """

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], device: torch.device,
                 pipes: LocalPipes | None = None, cpu_group: dist.ProcessGroup | None = None,
                 host_staged_collectives: bool = False):
        self.group = group
        self.ranks = ranks
        self.device = device
        # peers that share this rank's host (CPU) or GPU (CUDA): shared-memory pipes
        self.pipes = pipes
        self.cpu_group = cpu_group
        self.host_staged_collectives = host_staged_collectives
        self.stats = TrafficStats()
        self.trace: deque[CommEvent] | None = None  # see GroupCoordinator.instrument
        self.after_send: Callable[[], None] | None = None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        started = time.time() if self.trace is not None else 0.0
        if self.pipes is not None and self.pipes.reaches(dst):
            self.pipes.send(tensor, dst)
        else:
            dist.send(tensor, dst=self.ranks[dst], group=self.group)
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.sends += 1
        self.stats.bytes_sent += nbytes
        if self.trace is not None:
            self.trace.append(("send", dst, started, time.time(), nbytes))
        if self.after_send is not None:
            self.after_send()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        started = time.time() if self.trace is not None else 0.0
        if self.pipes is not None and self.pipes.reaches(src):
            self.pipes.recv_into(tensor, src)
        else:
            dist.recv(tensor, src=self.ranks[src], group=self.group)
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.recvs += 1
        self.stats.bytes_received += nbytes
        if self.trace is not None:
            self.trace.append(("recv", src, started, time.time(), nbytes))
        return tensor

    def transport(self, peer: int) -> str:
        """How tensors to and from ``peer`` (a rank in the group) travel."""
        if self.pipes is not None and self.pipes.reaches(peer):
            return "host-staged" if self.device.type == "cuda" else "shm-pipe"
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.host_staged_collectives:
            host = tensor.cpu()
            dist.all_reduce(host, group=self.cpu_group)
            return tensor.copy_(host)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        staged = self.host_staged_collectives
        source = tensor.cpu() if staged else tensor.contiguous()
        parts = [torch.empty_like(source) for _ in self.ranks]
        dist.all_gather(parts, source, group=self.cpu_group if staged else self.group)
        out = torch.cat(parts, dim=dim)
        return out.to(tensor.device) if staged else out


class GroupCoordinator:
    """One parallel group (TP, PP or world) as seen by one worker.

    Built collectively: every rank of the world must construct every group in
    the same order (``torch.distributed.new_group`` is collective), which
    :mod:`raypp.distributed.parallel_state` guarantees.
    """

    def __init__(self, name: str, ranks: list[int], device: torch.device,
                 device_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
                 timeout_s: float = 60.0, use_local_pipes: bool = True):
        self.name = name
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank = dist.get_rank()
        self.rank_in_group = self.ranks.index(self.rank)
        self.device_group = device_group
        self.cpu_group = cpu_group
        # where every rank of the group is: its host (CPU) or its host and GPU (CUDA)
        self.localities = self.all_gather_object(_locality(device))
        me = self.localities[self.rank_in_group]
        shares_device = device.type == "cuda" and self.localities.count(me) > 1
        pipes = None
        if (shares_device or (device.type == "cpu" and use_local_pipes)) and self.world_size > 1:
            pipes = self._local_pipes(timeout_s)
        self.device_communicator = DeviceCommunicator(
            device_group, self.ranks, device, pipes, cpu_group,
            host_staged_collectives=len(set(self.localities)) < self.world_size
            and device.type == "cuda")

    def _local_pipes(self, timeout_s: float) -> LocalPipes | None:
        """Collectively set up shared-memory pipes to the peers of the same locality."""
        if not local_pipes.supported():
            if any(self.localities.count(loc) > 1 for loc in self.localities):
                raise RuntimeError("ranks of one GPU need shared-memory pipes, which this "
                                   "platform lacks (Unix sockets and /dev/shm)")
            return None
        pipes = LocalPipes(self.rank_in_group, timeout_s)
        addresses = self.all_gather_object(pipes.address)
        me = self.localities[self.rank_in_group]
        pipes.connect_peers({r: addresses[r] for r, loc in enumerate(self.localities)
                             if loc == me})
        return pipes

    @property
    def shares_device(self) -> bool:
        """True when two ranks of this CUDA group share one GPU."""
        return self.device_communicator.host_staged_collectives

    def transports(self) -> dict[int, str]:
        """Peer rank in the group → how tensors to it travel (see the module docstring)."""
        return {peer: self.device_communicator.transport(peer)
                for peer in range(self.world_size) if peer != self.rank_in_group}

    @classmethod
    def build(cls, name: str, ranks: list[int], device: torch.device,
              timeout_s: float, use_local_pipes: bool = True) -> GroupCoordinator | None:
        """Collectively create the group's process groups; the coordinator if we are in it.

        Every rank of the world must call this for every group, in the same order.
        ``use_local_pipes`` (CPU): same-host peers exchange tensors over shared-memory
        pipes instead of gloo.
        """
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if dist.get_rank() not in ranks:
            return None
        return cls(name, ranks, device, device_group, cpu_group, timeout_s, use_local_pipes)

    def instrument(self, trace: bool, after_send: Callable[[], None] | None = None) -> None:
        """``trace``: record every point-to-point send/recv interval of this group
        (:func:`drain_comm_trace` returns them); ``after_send``: called after each
        tensor this rank sends (test-only fault injection)."""
        self.device_communicator.trace = _COMM_TRACE if trace else None
        self.device_communicator.after_send = after_send

    # -- topology, so stage code never does rank arithmetic ---------------------
    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank_in_group - 1) % self.world_size

    # -- tensors ----------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.device_communicator.send(tensor, dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        return self.device_communicator.recv(shape, dtype, src)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.device_communicator.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.device_communicator.all_gather(tensor, dim=dim % tensor.dim())

    # -- small objects over the CPU group ----------------------------------------
    def send_object(self, obj: Any, dst: int) -> None:
        pipes = self.device_communicator.pipes
        if pipes is not None and pipes.reaches(dst):  # same host: no gloo round
            pipes.send_bytes(pickle.dumps(obj), dst)
            return
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.send(size, dst=self.ranks[dst], group=self.cpu_group)
        dist.send(payload, dst=self.ranks[dst], group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        pipes = self.device_communicator.pipes
        if pipes is not None and pipes.reaches(src):
            return pickle.loads(pipes.recv_bytes(src))
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.ranks[src], group=self.cpu_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=self.ranks[src], group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    # -- a dict of tensors and plain values: metadata on CPU, tensors on device ----
    def send_tensor_dict(self, tensors: dict[str, Any], dst: int) -> None:
        metadata, payload = _split_tensor_dict(tensors)
        self.send_object(metadata, dst)
        for tensor in payload:
            self.send(tensor, dst)

    def wait_for_message(self, src: int, keep_waiting: Callable[[], bool]) -> None:
        """Wait until ``src`` starts sending, for as long as ``keep_waiting()`` is true: a
        peer on this host's shared-memory pipes (:meth:`LocalPipes.wait_message`). Across
        hosts (gloo) it returns at once, and the receive that follows waits at most the
        group's timeout."""
        pipes = self.device_communicator.pipes
        if pipes is not None and pipes.reaches(src):
            pipes.wait_message(src, keep_waiting)

    def recv_tensor_dict(self, src: int) -> dict[str, Any]:
        metadata = self.recv_object(src)
        out: dict[str, Any] = {}
        for key, value in metadata:
            if isinstance(value, _TensorMeta):
                out[key] = self.recv(value.shape, value.dtype, src)
            else:
                out[key] = value
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.device_communicator.pipes is not None:
            self.device_communicator.pipes.close()
        for group in (self.device_group, self.cpu_group):
            with contextlib.suppress(RuntimeError, ValueError):  # gone with the default group
                dist.destroy_process_group(group)


def _locality(device: torch.device) -> str:
    """Equal for exactly the ranks that may share memory: the host, and the GPU on CUDA."""
    host = local_pipes.host_id()
    if device.type != "cuda":
        return host
    return f"{host}/gpu-{torch.cuda.get_device_properties(device).uuid}"


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split_tensor_dict(tensors: dict[str, Any]) -> tuple[list[tuple[str, Any]], list[torch.Tensor]]:
    metadata: list[tuple[str, Any]] = []
    payload: list[torch.Tensor] = []
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor):
            metadata.append((key, _TensorMeta(tuple(value.shape), value.dtype)))
            payload.append(value)
        else:
            metadata.append((key, value))
    return metadata, payload
