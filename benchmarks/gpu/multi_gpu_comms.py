"""Which communicators a running engine has: per worker process, the torch.distributed
groups, the communicators Ray's channels use, GPU memory, and (CUDA) the NCCL
communicators NCCL itself reports in the Ray worker logs; per graph, the custom and
Ray-created communicators."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any


def _worker_probe(worker: Any) -> dict[str, Any]:
    """Runs inside a stage actor: pid, process groups, channel communicators, memory."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = []
    if dist.is_initialized():
        for pg, (backend, _store) in list(c10d._world.pg_map.items()):
            ranks = c10d._world.pg_group_ranks.get(pg, {})
            groups.append({"backend": str(backend), "ranks": sorted(ranks)})
    mem: dict[str, Any]
    if torch.cuda.is_available() and worker.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        mem = {"gpu_used_gib": round((total - free) / 2**30, 3),
               "torch_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
               "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3)}
    else:
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
        mem = {"rss_gib": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 3)}
    return {"pp_rank": worker.pp_rank, "tp_rank": worker.tp_rank, "pid": os.getpid(),
            "process_groups": groups, "channel_communicators": worker.channel_communicators(),
            "memory": mem}


def probe_workers(llm: Any) -> list[dict[str, Any]]:
    """:func:`_worker_probe` of every stage worker of ``llm``, in rank order."""
    import ray

    executor = llm.engine.executor
    return ray.get([w.__ray_call__.remote(_worker_probe) for w in executor.all_workers],
                   timeout=120)


# "host:pid:tid [dev] NCCL INFO [caller] comm 0x.. rank 0 nranks 2 ... commId 0x.. - Init COMPLETE"
_NCCL_PREFIX = re.compile(r"(\S+):(\d+):\d+ \[\d+\] NCCL INFO ")
_NCCL_FIELDS = {k: re.compile(p, re.IGNORECASE) for k, p in (
    ("comm", r"\bcomm (0x[0-9a-f]+)"), ("rank", r"\brank (\d+)"),
    ("nranks", r"\bnranks (\d+)"), ("comm_id", r"\bcommId (0x[0-9a-f]+)"))}


def ray_logs_dir() -> Path:
    """This Ray session's log folder (Ray's default location if it cannot say)."""
    try:
        import ray._private.worker as ray_worker

        return Path(ray_worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - fall back to Ray's default location
        return Path("/tmp/ray/session_latest/logs")


def nccl_inits(pids: list[int], logs: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """pid → the NCCL communicators whose init completed in that process, read from the
    "Init COMPLETE" lines (``NCCL_DEBUG=INFO``) in the Ray worker logs."""
    logs = logs or ray_logs_dir()
    wanted = {str(p) for p in pids}
    found: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in wanted}
    for path in sorted(logs.glob("worker-*")):
        if not path.name.endswith((".out", ".err")):
            continue
        with contextlib.suppress(OSError), path.open(errors="replace") as f:
            for number, line in enumerate(f):
                prefix = _NCCL_PREFIX.search(line)
                if "Init COMPLETE" not in line or not prefix or prefix.group(2) not in wanted:
                    continue
                fields = {k: m.group(1) for k, p in _NCCL_FIELDS.items()
                          if (m := p.search(line, prefix.end()))}
                for k in ("rank", "nranks"):
                    if k in fields:
                        fields[k] = int(fields[k])
                key = fields.get("comm") or f"{path.name}:{number}"
                found[prefix.group(2)][key] = fields
    return {pid: list(comms.values()) for pid, comms in found.items()}


def comm_report(llm: Any, device: str, stage: str) -> dict[str, Any]:
    """What communicators exist right now (``stage`` names the moment): per worker, and
    in the compiled graph (``graph``: ``{"custom", "ray_created"}``)."""
    executor = llm.engine.executor
    workers = probe_workers(llm)
    report: dict[str, Any] = {"when": stage, "graph": executor.graph_communicators(),
                              "workers": workers}
    if device == "cuda":
        inits = nccl_inits([w["pid"] for w in workers])
        for w in workers:
            w["nccl_comms"] = inits[str(w["pid"])]
        report["nccl_comms_per_worker"] = [len(w["nccl_comms"]) for w in workers]
        report["nccl_distinct_comm_ids"] = len({c["comm_id"] for w in workers
                                                for c in w["nccl_comms"]})
    else:  # gloo: every torch.distributed group is a communicator
        report["gloo_groups_per_worker"] = [
            sum(g["backend"] == "gloo" for g in w["process_groups"]) for w in workers]
    return report
