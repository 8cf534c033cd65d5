"""An HTTP server on a background thread, for tests and benchmarks.

What callers may rely on: :class:`ServerThread` binds its socket when it is
made (port 0 picks a free one); :meth:`ServerThread.start` returns once uvicorn
accepts connections (``RuntimeError`` if it did not start); :meth:`ServerThread.stop`
asks uvicorn to exit and closes the socket.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class ServerThread:
    """uvicorn serving ``app`` from a daemon thread on a socket bound up front (port 0
    picks a free one), for tests and benchmarks. ``url`` is valid after :meth:`start`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="raypp-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
