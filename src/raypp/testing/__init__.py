"""Tiny Hugging Face–format checkpoints for tests (:mod:`raypp.testing.tiny_model`), test
helpers, a server thread and a simulated multi-node cluster. The demo model's fetch is
product code: :mod:`raypp.demo`.
"""

import threading
import time
from typing import Any

import psutil


def wait_suspended(executor: Any, timeout: float = 30.0) -> bool:
    """Wait until an idle compiled-graph executor has suspended its graph (no step and
    no compiled-graph channel left); False if it did not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not executor.suspended and time.monotonic() < deadline:
        time.sleep(0.1)
    return executor.suspended


def cpu_use_against_idle_actor(pids: list[int], seconds: float) -> tuple[list[float], float]:
    """CPU use of ``pids`` (fraction of a core) over ``seconds``, and that of a Ray actor
    that has imported torch and does nothing, measured in the same window: what Ray's
    own threads cost on this machine at this moment, the floor for an idle stage."""
    import ray

    actor = ray.remote(num_cpus=0)(_IdleActor).remote()
    try:
        baseline_pid = ray.get(actor.pid.remote(), timeout=60)
        time.sleep(0.5)  # its start-up is not idling
        *used, baseline = cpu_fraction([*pids, baseline_pid], seconds)
    finally:
        ray.kill(actor)
    return used, baseline


def cpu_fraction(pids: list[int], seconds: float) -> list[float]:
    """Each process's CPU seconds per wall second (1.0 = one core busy throughout) over
    the next ``seconds``; ``psutil.NoSuchProcess`` for a process that is gone by then."""
    processes = [psutil.Process(pid) for pid in pids]
    before = [_cpu_seconds(p) for p in processes]
    started = time.monotonic()
    time.sleep(seconds)
    after = [_cpu_seconds(p) for p in processes]
    elapsed = time.monotonic() - started
    return [(b - a) / elapsed for a, b in zip(before, after)]


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class _IdleActor:
    def pid(self) -> int:
        import os

        import torch  # noqa: F401  (the runtime threads a stage has)

        return os.getpid()


def kill_stage_later(llm: Any, pp_rank: int, delay: float,
                     killed_at: list[float] | None = None) -> threading.Thread:
    """After ``delay`` seconds, in a daemon thread, kill stage ``pp_rank``'s first worker
    actor of ``llm`` (``ray.kill``, no restart); the kill's monotonic time is appended to
    ``killed_at``. Returns the started thread."""
    import ray

    namespace = llm.engine.executor.namespace

    def kill() -> None:
        time.sleep(delay)
        actor = ray.get_actor(f"raypp_worker_{pp_rank}_0", namespace=namespace)
        if killed_at is not None:
            killed_at.append(time.monotonic())
        ray.kill(actor, no_restart=True)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread
