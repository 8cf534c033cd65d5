"""Where benchmarks run: the cluster named by ``--ray-address``/``RAY_ADDRESS``, else a new one.

``ray.init()`` with no address silently joins a cluster that someone started on
this machine with ``ray start``; a benchmark must not measure someone else's
cluster by accident, so without an address it asks Ray for a fresh local one.
"""

from __future__ import annotations

import os


def start_ray(address: str | None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``), else start a private local cluster."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False)
        return
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
             object_store_memory=256 * 2**20, include_dashboard=False)
