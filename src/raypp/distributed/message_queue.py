"""Small pickled messages between the driver and stage loops, over ZeroMQ PUSH/PULL.

A :class:`Sender` (PUSH) and a :class:`Receiver` (PULL) form a FIFO queue: while
both ends live, messages arrive once, in order. Every wait is bounded and
blocking — ``zmq_poll`` sleeps in the kernel, so an idle queue costs no CPU.

Addresses are picked at runtime, never fixed: the binding side asks for
``ipc://`` (a Unix socket in a private temporary directory) when every peer is
on its node, and ``tcp://<ip>:*`` (an OS-chosen port) when a peer is on another
node. :attr:`Sender.address` / :attr:`Receiver.addresses` give what peers
connect to. Messages are pickled, so only bind where trusted peers can reach.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import uuid
from typing import Any

import zmq

_HWM = 10_000  # far above any number of steps in flight


def new_context() -> zmq.Context:
    """A private ZeroMQ context (one I/O thread, asleep in epoll when idle)."""
    return zmq.Context(io_threads=1)


class IpcDir:
    """A private directory for ``ipc://`` socket files; :meth:`remove` deletes it."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="raypp-")

    def address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, f'{name}-{uuid.uuid4().hex[:8]}')}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def tcp_address(ip: str) -> str:
    """A bind address on ``ip`` whose port the OS picks at bind time."""
    return f"tcp://{ip}:*"


class _Socket:
    def __init__(self, ctx: zmq.Context, kind: int):
        self._sock = ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)  # close never blocks on undelivered messages

    def _bind(self, address: str) -> str:
        self._sock.bind(address)
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        """Close now; undelivered messages are dropped (idempotent)."""
        self._sock.close(linger=0)


class Sender(_Socket):
    """The sending end of a queue (a PUSH socket)."""

    def __init__(self, ctx: zmq.Context, *, bind: str | None = None, connect: str | None = None):
        super().__init__(ctx, zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self.address = self._bind(bind) if bind else connect
        if connect:
            self._sock.connect(connect)

    def send(self, obj: Any, timeout_s: float) -> None:
        """Queue ``obj`` (pickled) for the peer.

        Returns once ZeroMQ holds the message; raises ``TimeoutError`` if no peer
        could take it within ``timeout_s`` (no peer connected, or the queue full).
        """
        if obj is None:
            raise ValueError("None is reserved for 'nothing arrived'; send another value")
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout_s)

    def send_bytes(self, data: bytes, timeout_s: float) -> None:
        """:meth:`send` for a message already pickled (to send one to many peers)."""
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise TimeoutError(f"no peer took a message on {self.address} within {timeout_s:g} s")
        self._sock.send(data, copy=False)


class Receiver(_Socket):
    """The receiving end of a queue (a PULL socket); may bind several addresses."""

    def __init__(self, ctx: zmq.Context, *, bind: list[str] | None = None,
                 connect: str | None = None):
        super().__init__(ctx, zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self.addresses = [self._bind(a) for a in bind or []]
        if connect:
            self._sock.connect(connect)
            self.addresses = [connect]

    def recv(self, timeout_s: float) -> Any:
        """The next message, or ``None`` if none arrived within ``timeout_s``.

        Blocks without spinning. ``None`` is never sent as a message.
        """
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return pickle.loads(self._sock.recv(copy=False).buffer)
