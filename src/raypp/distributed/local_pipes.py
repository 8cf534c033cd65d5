"""Point-to-point tensor transfer between CPU ranks on the same host.

gloo moves a CPU tensor through a TCP loopback connection and its own I/O
thread, waking four threads per message; measured inside a compiled graph on
2 cores that cost ~1.9 ms per 16 KiB message against 0.17 ms outside it.

Here each sender owns a shared-memory ring of ``_SLOTS`` slots per peer: ``send``
copies the tensor into the next free slot and writes a small header on a Unix
stream socket; ``recv_into`` waits (blocking, never spinning, with a timeout)
for the header, copies the slot into the caller's tensor and answers one ack
byte that frees the slot. With two slots the sender runs one message ahead of
the receiver. A message larger than the slots makes the sender drain its acks
and switch to a larger segment, whose name travels in the header.

The same pipes carry CUDA tensors between ranks that share one GPU (NCCL refuses
two ranks on a device): the sender copies device memory into the slot, the receiver
copies the slot into its device tensor — staged through host memory, one copy each way.

Sockets live in Linux's abstract namespace and segments in /dev/shm under random
names; the receiver unlinks a segment as soon as it mapped it, and a closing
sender removes a name no receiver mapped. A name outlives its processes only if
the sender is killed between creating a segment and the receiver mapping it.
Ranks on other hosts keep using gloo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import struct
import threading
import uuid
from collections.abc import Callable

import numpy as np
import torch

_HEADER = struct.Struct("<qQii")  # sender rank, payload bytes, slot, length of a new segment name
_SLOTS = 2
_MIN_SLOT_BYTES = 1 << 20
_SHM_DIR = "/dev/shm"


def host_id() -> str:
    """Same value exactly for processes that share a kernel (and so can share sockets)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def supported() -> bool:
    return (hasattr(socket, "AF_UNIX") and os.path.isdir(_SHM_DIR)
            and os.path.exists("/proc/sys/kernel/random/boot_id"))


class _Ring:
    """One direction's shared-memory slots (the sender creates, the receiver maps)."""

    def __init__(self, mapping: mmap.mmap, slot_bytes: int, name: str | None = None):
        self.map = mapping
        self.slot_bytes = slot_bytes
        self.name = name  # set on the sender's side only
        self.next_slot = 0
        self.unacked = 0

    @classmethod
    def create(cls, nbytes: int) -> tuple[_Ring, str]:
        slot = max(_MIN_SLOT_BYTES, 1 << max(0, nbytes - 1).bit_length())
        name = f"raypp-{uuid.uuid4().hex}"
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, slot * _SLOTS)
            mapping = mmap.mmap(fd, slot * _SLOTS)
        finally:
            os.close(fd)
        return cls(mapping, slot, name), name

    @classmethod
    def attach(cls, name: str) -> _Ring:
        path = os.path.join(_SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            os.unlink(path)  # both ends have it mapped: the name is no longer needed
        return cls(mapping, size // _SLOTS)

    def slot_array(self, slot: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=slot * self.slot_bytes)

    def write(self, slot: int, tensor: torch.Tensor) -> int:
        """Copy a contiguous tensor (any device) into ``slot``; returns its bytes."""
        if tensor.device.type == "cpu":
            data = _bytes(tensor)
            self.slot_array(slot, data.nbytes)[:] = data
            return data.nbytes
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            self._slot_tensor(slot, nbytes).copy_(tensor.reshape(-1).view(torch.uint8))
        return nbytes

    def read(self, slot: int, tensor: torch.Tensor) -> None:
        """Fill a contiguous tensor (any device) from ``slot``."""
        if tensor.device.type == "cpu":
            data = _bytes(tensor)
            data[:] = self.slot_array(slot, data.nbytes)
            return
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:  # from pageable memory: returns once the slot was read
            tensor.reshape(-1).view(torch.uint8).copy_(self._slot_tensor(slot, nbytes))

    def _slot_tensor(self, slot: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes,
                                offset=slot * self.slot_bytes)

    def close(self) -> None:
        """Unmap; the sender also removes the name if no receiver ever mapped it."""
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        if self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))


class LocalPipes:
    """One rank's sockets to its same-host peers (ranks within the group).

    ``send`` returns once the bytes are in the kernel (or the peer took them);
    ``recv_into`` fills a caller-provided contiguous tensor. Both raise
    ``RuntimeError`` when the peer is gone or after ``timeout_s`` without progress.
    """

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.address = f"\0raypp-{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._listener.settimeout(timeout_s)
        self._peers: dict[int, str] = {}
        self._out: dict[int, socket.socket] = {}
        self._in: dict[int, socket.socket] = {}
        self._out_rings: dict[int, _Ring] = {}
        self._in_rings: dict[int, _Ring] = {}
        self._accept_lock = threading.Lock()
        self._last_nbytes = 0

    def connect_peers(self, addresses: dict[int, str]) -> None:
        """Record the listening address of every same-host peer (no connection yet)."""
        self._peers = {r: a for r, a in addresses.items() if r != self.rank}

    def reaches(self, peer: int) -> bool:
        return peer in self._peers

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """``tensor`` (contiguous, on the CPU or a GPU) to ``dst``."""
        sock = self._out.get(dst) or self._connect(dst)
        nbytes = tensor.numel() * tensor.element_size()
        ring, new_name = self._out_rings.get(dst), b""
        if ring is None or nbytes > ring.slot_bytes:
            if ring is not None:
                self._wait_acks(sock, ring, dst, until=0)
                ring.close()
            ring, name = _Ring.create(nbytes)
            self._out_rings[dst], new_name = ring, name.encode()
        self._wait_acks(sock, ring, dst, until=_SLOTS - 1)
        slot = ring.next_slot
        ring.write(slot, tensor)
        try:
            sock.sendall(_HEADER.pack(self.rank, nbytes, slot, len(new_name)) + new_name)
        except OSError as e:
            raise RuntimeError(f"local pipe to rank {dst} failed: {e}") from e
        ring.next_slot = (slot + 1) % _SLOTS
        ring.unacked += 1

    def _wait_acks(self, sock: socket.socket, ring: _Ring, dst: int, until: int) -> None:
        """Block until at most ``until`` slots are still being read by ``dst``."""
        while ring.unacked > until:
            acks = _recv_exactly(sock, 1, dst, at_most=ring.unacked)
            ring.unacked -= len(acks)

    def recv_into(self, tensor: torch.Tensor, src: int) -> None:
        """Fill ``tensor`` (contiguous, on the CPU or a GPU) with the next message from ``src``."""
        sock, ring, slot = self._next_message(src, expect=tensor.numel() * tensor.element_size())
        ring.read(slot, tensor)
        self._ack(sock, src)

    def send_bytes(self, payload: bytes, dst: int) -> None:
        self.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst)

    def recv_bytes(self, src: int) -> bytes:
        """The next message from ``src`` whatever its size (pairs with :meth:`send_bytes`)."""
        sock, ring, slot = self._next_message(src, expect=None)
        data = ring.slot_array(slot, self._last_nbytes).tobytes()
        self._ack(sock, src)
        return data

    def _next_message(self, src: int, expect: int | None) -> tuple[socket.socket, _Ring, int]:
        sock = self._in.get(src) or self._accept(src)
        sender, nbytes, slot, name_len = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, src))
        if name_len:
            old = self._in_rings.pop(src, None)
            if old is not None:
                old.close()
            name = _recv_exactly(sock, name_len, src).decode()
            self._in_rings[src] = _Ring.attach(name)
        if sender != src or (expect is not None and nbytes != expect):
            raise RuntimeError(f"local pipe from rank {src}: expected {expect} bytes from "
                               f"rank {src}, got {nbytes} from rank {sender}")
        self._last_nbytes = nbytes
        return sock, self._in_rings[src], slot

    @staticmethod
    def _ack(sock: socket.socket, src: int) -> None:
        try:
            sock.sendall(b"\x01")  # the slot is free again
        except OSError as e:
            raise RuntimeError(f"local pipe to rank {src} failed: {e}") from e

    def _connect(self, dst: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self._peers[dst])
            sock.sendall(struct.pack("<q", self.rank))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot reach rank {dst} over its local pipe: {e}") from e
        self._out[dst] = sock
        return sock

    def _accept(self, src: int) -> socket.socket:
        with self._accept_lock:
            while src not in self._in:
                self._accept_one(src)
        return self._in[src]

    def _accept_one(self, src: int) -> None:
        """Accept the next peer's connection (waiting for ``src``'s, up to ``timeout_s``)."""
        try:
            conn, _ = self._listener.accept()
        except OSError as e:  # includes timeout
            raise RuntimeError(f"rank {src} never connected its local pipe: {e}") from e
        conn.settimeout(self.timeout_s)
        (peer,) = struct.unpack("<q", _recv_exactly(conn, 8, -1))
        self._in[peer] = conn

    def wait_message(self, src: int, keep_waiting: Callable[[], bool]) -> None:
        """Return once ``src`` has a message for :meth:`recv_into` or :meth:`recv_bytes`
        (or closed its pipe: the receive then fails at once). Waits in slices of at most a
        second for as long as ``keep_waiting()`` is true, so a sender that takes long to
        send (a long step upstream) is waited for, however long; ``RuntimeError`` once
        ``keep_waiting()`` is false. Whoever calls it bounds the wait: a dead sender on this
        host closes its socket, and the engine replaces a stuck one."""
        slice_s = min(1.0, self.timeout_s)
        while True:
            sock = self._in.get(src)
            ready, _, _ = select.select([sock if sock is not None else self._listener], [], [],
                                        slice_s)
            if ready and sock is not None:
                return
            if ready:
                with self._accept_lock:
                    if src not in self._in:
                        self._accept_one(src)
                continue
            if not keep_waiting():
                raise RuntimeError(f"stopped waiting for a message from rank {src}")

    def close(self) -> None:
        for ring in [*self._out_rings.values(), *self._in_rings.values()]:
            ring.close()
        for sock in [*self._out.values(), *self._in.values(), self._listener]:
            with contextlib.suppress(OSError):
                sock.close()
        self._out.clear()
        self._in.clear()
        self._out_rings.clear()
        self._in_rings.clear()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 array (a view: writes land in the tensor)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _recv_exactly(sock: socket.socket, n: int, peer: int, at_most: int | None = None) -> bytes:
    """Exactly ``n`` bytes, or with ``at_most``: between ``n`` and ``at_most`` bytes."""
    buf = bytearray(at_most or n)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(memoryview(buf)[got:])
        except OSError as e:  # includes timeout
            raise RuntimeError(f"local pipe with rank {peer} failed: {e}") from e
        if k == 0:
            raise RuntimeError(f"local pipe with rank {peer} closed: the peer is gone")
        got += k
    return bytes(buf[:got])
