"""``raypp bench hop``: the per-step cost of one compiled-graph hop, per transport.

The driver sends an int ``n``; stage 0 produces an ``(n, hidden)`` fp32 tensor;
middle stages pass it on; the last stage returns ``n``. One step is one
``ray.get(dag.execute(n))``, timed on the driver. Transports:

- ``raypp``: edges annotated with :class:`RayPPCommunicator` over a real gloo PP
  group (``parallel_state.init_distributed`` + the ``ray_compat`` shim), exactly
  as the engine wires them;
- ``shm``: ``with_tensor_transport(transport="shm")``;
- ``default``: no annotation (Ray pickles the value through its shm channel);
- ``actor``: plain actor calls chained through object refs, no compiled graph.

With one stage there is no hop; that row is the fixed cost of a compiled-graph
round trip (driver → stage → driver), which the other rows include too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from raypp.bench.cpu import CpuMeter
from raypp.bench.report import format_table, percentile, run_context, summarize, write_json
from raypp.config import ParallelConfig, RuntimeConfig
from raypp.distributed.ports import free_port
from raypp.executor.stage_pool import ensure_ray

TRANSPORTS = ("raypp", "shm", "default", "actor")
_TRANSPORT_LABELS = {
    "raypp": "RayPPCommunicator (PP group)",
    "shm": "Ray shm transport",
    "default": "Ray default (no annotation)",
    "actor": "plain actor calls",
}


class HopStage:
    """A bench stage actor: one rank of a real PP group (gloo on CPU, NCCL on CUDA)
    that makes, forwards or consumes ``(n, hidden)`` tensors. Also used by
    the multi-GPU lab suite (``benchmarks/gpu/multi_gpu_hop.py``)."""

    def __init__(self, rank: int, world: int, hidden: int, device: str = "cpu",
                 dtype: str = "float32"):
        import torch

        from raypp.distributed import ray_compat

        self.rank, self.world, self.hidden = rank, world, hidden
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)
        ray_compat.apply(on_cpu=self.device.type == "cpu")
        self.dtype = getattr(torch, dtype)
        self._tensors: dict[int, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def init_group(self, init_method: str, timeout_s: float, use_local_pipes: bool = True) -> None:
        from raypp.distributed import parallel_state

        layout = parallel_state.RankLayout(tp_size=1, pp_size=self.world)
        parallel_state.init_distributed(layout, self.rank, init_method, self.device, timeout_s,
                                        use_local_pipes)
        parallel_state.get_pp_group().instrument(trace=True)  # to split a hop's time

    def first(self, n: int) -> Any:
        import torch

        if n not in self._tensors:  # made once: the step measures the hop, not the fill
            self._tensors[n] = torch.ones(n, self.hidden, dtype=self.dtype, device=self.device)
        return self._tensors[n]

    def mid(self, x: Any) -> Any:
        return x

    def last(self, x: Any) -> int:
        self._sync()
        return int(x.shape[0])

    def only(self, n: int) -> int:
        return int(self.first(n).shape[0])

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def raw_pingpong(self, n: int, steps: int, warmup: int) -> list[float]:
        """Ranks 0 and 1 bounce an ``(n, hidden)`` tensor over the PP group with no
        compiled graph (torch.distributed / same-host pipes); rank 0 returns one-way seconds."""
        from raypp.distributed import parallel_state

        group = parallel_state.get_pp_group()
        buf = self.first(n)
        peer = 1 - self.rank
        times = []
        for i in range(warmup + steps):
            started = time.perf_counter()
            if self.rank == 0:
                group.send(buf, peer)
                group.recv(tuple(buf.shape), buf.dtype, peer)
            else:
                got = group.recv(tuple(buf.shape), buf.dtype, peer)
                group.send(got, peer)
            self._sync()
            if i >= warmup:
                times.append((time.perf_counter() - started) / 2)
        return times

    def drain_comm_trace(self) -> list[tuple[str, int, float, float, int]]:
        from raypp.distributed.communicator import drain_comm_trace

        return drain_comm_trace()

    def shutdown(self) -> None:
        from raypp.distributed import parallel_state

        parallel_state.destroy_distributed()


# -- set-up -------------------------------------------------------------------------------
def _start_stages(num_stages: int, hidden: int) -> tuple[list[Any], dict[str, int]]:
    import ray

    env = {k: v for k, v in os.environ.items() if k.startswith("RAY_CGRAPH_")}
    actor_cls = ray.remote(num_cpus=0)(HopStage)
    stages = [actor_cls.options(runtime_env={"env_vars": env}).remote(r, num_stages, hidden)
              for r in range(num_stages)]
    pids = ray.get([s.pid.remote() for s in stages], timeout=300)
    if num_stages > 1:
        init_method = ray.get(stages[0].rendezvous_address.remote())
        runtime, parallel = RuntimeConfig(), ParallelConfig()  # the RAYPP_* defaults
        ray.get([s.init_group.remote(init_method, runtime.dist_timeout_s,
                                     parallel.cpu_p2p == "auto") for s in stages], timeout=300)
    return stages, {f"stage{i}": pid for i, pid in enumerate(pids)}


def _stop_stages(stages: list[Any]) -> None:
    import ray

    for s in stages:
        with contextlib.suppress(Exception):  # killed next anyway
            ray.get(s.shutdown.remote(), timeout=30)
        ray.kill(s, no_restart=True)


def _compile(stages: list[Any], transport: str, buffer_bytes: int, inflight: int) -> Any:
    from ray.dag import InputNode

    from raypp.distributed.ray_communicator import RayPPCommunicator

    comm = RayPPCommunicator(stages) if transport == "raypp" else None

    def annotate(node: Any) -> Any:
        if transport == "raypp":
            return node.with_tensor_transport(transport=comm)
        if transport == "shm":
            return node.with_tensor_transport(transport="shm")
        return node  # "default": no annotation

    with InputNode() as inp:
        if len(stages) == 1:
            node = stages[0].only.bind(inp)
        else:
            node = annotate(stages[0].first.bind(inp))
            for stage in stages[1:-1]:
                node = annotate(stage.mid.bind(node))
            node = stages[-1].last.bind(node)
    return node.experimental_compile(_buffer_size_bytes=buffer_bytes,
                                     _max_inflight_executions=max(2, inflight))


def _actor_call(stages: list[Any]) -> Callable[[int], Any]:
    if len(stages) == 1:
        return lambda n: stages[0].only.remote(n)

    def call(n: int) -> Any:
        ref = stages[0].first.remote(n)
        for stage in stages[1:-1]:
            ref = stage.mid.remote(ref)
        return stages[-1].last.remote(ref)

    return call


# -- timing ---------------------------------------------------------------------------------
def _time_steps(submit: Callable[[int], Any], n: int, steps: int, warmup: int,
                inflight: int) -> list[float]:
    """Per-step seconds: one call's latency at ``inflight`` 1, else the gap between
    successive completions with ``inflight`` steps outstanding."""
    import ray

    for _ in range(warmup):
        assert ray.get(submit(n)) == n
    if inflight <= 1:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            assert ray.get(submit(n)) == n
            times.append(time.perf_counter() - started)
        return times
    pending = [submit(n) for _ in range(inflight)]
    last, times, done = time.perf_counter(), [], 0
    while done < steps:
        assert ray.get(pending.pop(0)) == n
        now = time.perf_counter()
        times.append(now - last)
        last, done = now, done + 1
        if done + len(pending) < steps:
            pending.append(submit(n))
    return times


def _comm_split(stages: list[Any]) -> dict[str, float]:
    """Median send and recv time (ms) inside RayPPCommunicator since the last drain."""
    import ray

    events = [e for trace in ray.get([s.drain_comm_trace.remote() for s in stages]) for e in trace]
    sends = [e[3] - e[2] for e in events if e[0] == "send"]
    recvs = [e[3] - e[2] for e in events if e[0] == "recv"]
    return {"send_p50_ms": 1e3 * percentile(sends, 50), "recv_p50_ms": 1e3 * percentile(recvs, 50)}


def _measure(stages: list[Any], pids: dict[str, int], transport: str, rows: int,
             args: argparse.Namespace, dag: Any) -> dict[str, Any]:
    submit = _actor_call(stages) if transport == "actor" else dag.execute
    _time_steps(submit, rows, args.warmup, 0, 1)
    if transport == "raypp":
        import ray

        ray.get([s.drain_comm_trace.remote() for s in stages])  # drop the warm-up's
    meter = CpuMeter.with_driver(pids)
    meter.start()
    started = time.perf_counter()
    times = _time_steps(submit, rows, args.steps, 0, args.inflight)
    cpu = meter.stop(time.perf_counter() - started)
    stats = {k: (v * 1e3 if k != "n" else v) for k, v in summarize(times).items()}
    row: dict[str, Any] = {
        "stages": len(stages),
        "transport": transport,
        "rows": rows,
        "bytes": rows * args.hidden * 4,
        "p50_ms": stats["p50"],
        "p90_ms": stats["p90"],
        "mean_ms": stats["mean"],
        "min_ms": stats["min"],
        "max_ms": stats["max"],
        "steps": stats["n"],
        "cpu": cpu,
        "cpu_cores_total": round(sum(p["cores"] or 0 for p in cpu.values()), 2),
    }
    if transport == "raypp":
        row.update(_comm_split(stages))
    return row


def _bench_stage_count(num_stages: int, args: argparse.Namespace) -> tuple[list, list]:
    stages, pids = _start_stages(num_stages, args.hidden)
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    buffer_bytes = max(4_000_000, 2 * max(args.sizes) * args.hidden * 4 + 2**20)  # probe F4
    transports = ["default", "actor"] if num_stages == 1 else args.transports
    try:
        for transport in transports:
            if num_stages == 1 and transport not in args.transports:
                continue
            dag = None if transport == "actor" else _compile(stages, transport, buffer_bytes,
                                                             args.inflight)
            try:
                for n in args.sizes:
                    rows.append(_measure(stages, pids, transport, n, args, dag))
                    _progress(rows[-1])
            finally:
                if dag is not None:
                    dag.teardown()
        if num_stages == 2 and args.gloo_raw:
            import ray

            for n in args.sizes:
                times = ray.get([s.raw_pingpong.remote(n, args.steps, args.warmup)
                                 for s in stages])[0]
                stats = summarize(times)
                raw.append({"rows": n, "bytes": n * args.hidden * 4,
                            "one_way_p50_ms": 1e3 * stats["p50"],
                            "one_way_p90_ms": 1e3 * stats["p90"]})
    finally:
        _stop_stages(stages)
    return rows, raw


def _progress(row: dict[str, Any]) -> None:
    print(f"  {row['stages']} stage(s) {row['transport']:>8} {row['rows']:>3}x: "
          f"p50 {row['p50_ms']:.2f} ms, p90 {row['p90_ms']:.2f} ms", flush=True)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    shm = {(r["stages"], r["rows"]): r["p50_ms"] for r in rows if r["transport"] == "shm"}
    for r in rows:
        ref = shm.get((r["stages"], r["rows"]))
        r["p50_vs_shm"] = round(r["p50_ms"] / ref, 2) if ref else None


def run_hop_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the hop benchmark described by parsed ``add_hop_args`` options."""
    ensure_ray(getattr(args, "ray_address", None))
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for num_stages in args.stages:
        r, g = _bench_stage_count(num_stages, args)
        rows += r
        raw += g
    _add_ratios(rows)
    result = {
        "benchmark": "hop",
        "hidden": args.hidden,
        "dtype": "float32",
        "steps": args.steps,
        "warmup": args.warmup,
        "inflight": args.inflight,
        "rows": rows,
        "gloo_raw": raw,
        "load_avg_at_start": load_at_start,
        "context": run_context(),
    }
    print(hop_table(result))
    if args.json:
        write_json(args.json, result)
    return result


def hop_table(result: dict[str, Any]) -> str:
    """The results as a printable table (one line per stages × transport × size)."""
    lines = [format_table(
        ["stages", "transport", "tensor", "p50 ms", "p90 ms", "x shm", "send/recv p50 ms", "cpu"],
        [
            (r["stages"], _TRANSPORT_LABELS[r["transport"]], f"{r['rows']}x{result['hidden']}",
             r["p50_ms"], r["p90_ms"], r["p50_vs_shm"] if r["p50_vs_shm"] else "-",
             f"{r['send_p50_ms']:.2f}/{r['recv_p50_ms']:.2f}" if "send_p50_ms" in r else "-",
             r["cpu_cores_total"])
            for r in result["rows"]
        ],
    )]
    if result["gloo_raw"]:
        lines.append("\nraw gloo over the PP group, no compiled graph (one-way):")
        lines.append(format_table(
            ["tensor", "p50 ms", "p90 ms"],
            [(f"{r['rows']}x{result['hidden']}", r["one_way_p50_ms"], r["one_way_p90_ms"])
             for r in result["gloo_raw"]],
        ))
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _transport_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [n for n in names if n not in TRANSPORTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {bad}; choose from {TRANSPORTS}")
    return names


def add_hop_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=4096, help="tensor width H (fp32)")
    parser.add_argument("--sizes", type=_int_list, default=[1, 64],
                        help="tensor rows, comma-separated (default 1,64)")
    parser.add_argument("--stages", type=_int_list, default=[1, 2, 3],
                        help="stage counts, comma-separated; 1 = no hop (baseline)")
    parser.add_argument("--transports", type=_transport_list, default=list(TRANSPORTS),
                        help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per row")
    parser.add_argument("--inflight", type=int, default=1,
                        help="steps outstanding; >1 reports the gap between completions")
    parser.add_argument("--no-gloo-raw", dest="gloo_raw", action="store_false",
                        help="skip the raw gloo ping-pong between two stages")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write results as JSON")
