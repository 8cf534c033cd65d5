"""Where the CPU went during a benchmark: per-process and per-thread CPU seconds.

A compiled graph's stage loops wait on their channels by polling, so on a small
machine the interesting question is how much CPU each process burns beyond its
compute. :class:`CpuMeter` snapshots ``/proc`` (via psutil) before and after.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil


def _thread_name(pid: int, tid: int) -> str:
    """The OS thread name, with ``main`` for the process's main thread."""
    try:
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        name = "?"
    return f"{name} (main)" if tid == pid else f"{name} ({tid})"


def _snapshot(pid: int) -> dict[str, Any] | None:
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        threads = {t.id: t.user_time + t.system_time for t in proc.threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return {"cpu_s": times.user + times.system, "threads": threads}


class CpuMeter:
    """CPU seconds used by named processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int]):
        self.pids = dict(pids)
        self._before: dict[str, dict[str, Any] | None] = {}

    @classmethod
    def with_driver(cls, pids: dict[str, int]) -> CpuMeter:
        return cls({"driver": os.getpid(), **pids})

    def start(self) -> None:
        self._before = {name: _snapshot(pid) for name, pid in self.pids.items()}

    def stop(self, elapsed_s: float, top_threads: int = 3) -> dict[str, Any]:
        """``{name: {"cpu_s", "cores", "threads": [{"name", "cpu_s"}...]}}``.

        ``cores`` is CPU seconds per wall second (1.0 = one core busy throughout);
        ``threads`` lists the busiest threads of the process.
        """
        out: dict[str, Any] = {}
        for name, pid in self.pids.items():
            before, after = self._before.get(name), _snapshot(pid)
            if before is None or after is None:
                continue
            busy = sorted(
                ((tid, cpu - before["threads"].get(tid, 0.0))
                 for tid, cpu in after["threads"].items()),
                key=lambda item: -item[1],
            )[:top_threads]
            cpu_s = after["cpu_s"] - before["cpu_s"]
            out[name] = {
                "pid": pid,
                "cpu_s": round(cpu_s, 3),
                "cores": round(cpu_s / elapsed_s, 3) if elapsed_s > 0 else None,
                "threads": [{"name": _thread_name(pid, tid), "cpu_s": round(cpu, 3)}
                            for tid, cpu in busy],
            }
        return out
