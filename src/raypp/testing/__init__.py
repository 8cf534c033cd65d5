"""Tiny Hugging Face–format checkpoints for tests (:mod:`raypp.testing.tiny_model`), test
helpers, a server thread and a simulated multi-node cluster. The demo model's fetch is
product code: :mod:`raypp.demo`.
"""

import time
from typing import Any


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

    from raypp.bench.cpu import cpu_fraction

    actor = ray.remote(num_cpus=0)(_IdleActor).remote()
    try:
        baseline_pid = ray.get(actor.pid.remote(), timeout=60)
        time.sleep(0.5)  # its start-up is not idling
        *used, baseline = cpu_fraction([*pids, baseline_pid], seconds)
    finally:
        ray.kill(actor)
    return used, baseline


class _IdleActor:
    def pid(self) -> int:
        import os

        import torch  # noqa: F401  (the runtime threads a stage has)

        return os.getpid()
