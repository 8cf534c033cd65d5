"""A TCP port for a ``torch.distributed`` rendezvous.

The address is chosen in one process and bound later by another (rank 0's TCP
store), so a port that is free when chosen may be taken in between. Ports the
kernel hands out for outgoing connections and ``bind(0)`` (the ephemeral range,
``net.ipv4.ip_local_port_range``) are the likeliest to be: a local test run saw
``EADDRINUSE`` on one. So the port is drawn at random below that range, where only
a listener that asks for it by number can collide, and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(ip: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port on ``ip`` free right now, outside the ephemeral range when one is."""
    high = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(attempts if high > _LOWEST else 0):
        port = rng.randrange(_LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
