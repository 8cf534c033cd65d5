"""Pipeline timelines: what each stage and the driver did, when.

Sources, all wall-clock (``time.time``) on one host:

- per-stage compute intervals from ``Executor.traced_intervals()`` (recorded
  by ``StageWorker.execute_step`` when ``LLMEngine.trace_steps`` is on). Each
  stage runs micro-batches in submission order, so the k-th interval of a stage
  is the k-th traced step the driver submitted;
- per-stage send/recv intervals of :class:`RayPPCommunicator` (only when the
  engine started with ``RAYPP_TRACE_COMM=1``);
- driver-side submit and wait intervals from :class:`raypp.bench.steps.StepRecorder`.

Outputs: a Chrome trace (open in https://ui.perfetto.dev; one track per stage
plus the driver) and a PNG Gantt chart in which idle stages (bubbles) are white.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Timeline:
    """Everything needed to draw one run. Times are absolute wall-clock seconds."""

    num_stages: int
    # (stage, step_id or -1, start, end)
    compute: list[tuple[int, int, float, float]] = field(default_factory=list)
    # (stage, "send"|"recv", peer, start, end, nbytes)
    comm: list[tuple[int, str, int, float, float, int]] = field(default_factory=list)
    # ("submit"|"wait", step_id, start, end)
    driver: list[tuple[str, int, float, float]] = field(default_factory=list)
    # step_id -> {"tokens": int, "seqs": int}
    steps: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def start(self) -> float:
        times = [c[2] for c in self.compute] + [d[2] for d in self.driver]
        return min(times) if times else 0.0

    @property
    def end(self) -> float:
        times = [c[3] for c in self.compute] + [d[3] for d in self.driver]
        return max(times) if times else 0.0

    def busy_shares(self) -> list[float]:
        """Per stage: compute time / the run's span (1.0 = never idle)."""
        span = self.end - self.start
        busy = [0.0] * self.num_stages
        for stage, _, start, end in self.compute:
            busy[stage] += end - start
        return [round(b / span, 4) if span > 0 else 0.0 for b in busy]

    def compute_ms(self) -> list[dict[str, float]]:
        """Per stage: p50 and mean compute time of one micro-batch, in ms."""
        from raypp.bench.report import summarize

        out = []
        for k in range(self.num_stages):
            s = summarize([1e3 * (c[3] - c[2]) for c in self.compute if c[0] == k])
            out.append({"p50": round(s.get("p50", 0.0), 3), "mean": round(s.get("mean", 0.0), 3)})
        return out

    def comm_shares(self) -> list[float]:
        """Per stage: time inside send/recv / the run's span."""
        span = self.end - self.start
        busy = [0.0] * self.num_stages
        for stage, _, _, start, end, _ in self.comm:
            busy[stage] += end - start
        return [round(b / span, 4) if span > 0 else 0.0 for b in busy]


def drain_stage_comm(executor: Any) -> list[list[tuple[str, int, float, float, int]]]:
    """Send/recv events recorded in each stage (index = PP rank) since the last drain."""
    import ray

    refs = [lane[0].drain_comm_trace.remote() for lane in executor.workers]
    return ray.get(refs, timeout=60)


def collect(executor: Any, recorder: Any) -> Timeline:
    """Build a :class:`Timeline` from the executor's traces and a ``StepRecorder``."""
    tl = Timeline(num_stages=len(executor.workers))
    traced = [s for s in recorder.submits if s.traced]
    for s in recorder.submits:
        tl.steps[s.step_id] = {"tokens": s.num_tokens, "seqs": s.num_seqs}
        tl.driver.append(("submit", s.step_id, s.start, s.end))
    tl.driver += [("wait", w.step_id, w.start, w.end) for w in recorder.waits]
    by_stage: dict[int, list[tuple[float, float]]] = {}
    for stage, start, end in executor.traced_intervals():
        by_stage.setdefault(stage, []).append((start, end))
    for stage, intervals in by_stage.items():
        intervals.sort()
        ids = [s.step_id for s in traced] if len(traced) == len(intervals) else []
        for i, (start, end) in enumerate(intervals):
            tl.compute.append((stage, ids[i] if ids else -1, start, end))
    lo, hi = tl.start, tl.end  # keep only traffic of the recorded run
    for stage, events in enumerate(drain_stage_comm(executor)):
        tl.comm += [(stage, op, peer, start, end, nbytes)
                    for op, peer, start, end, nbytes in events if end >= lo and start <= hi]
    return tl


# -- Chrome trace ---------------------------------------------------------------------------
def to_chrome_trace(tl: Timeline) -> dict[str, Any]:
    """Chrome trace-event JSON: pid 1, tid 0 = driver, tid k+1 = stage k."""
    t0 = tl.start
    us = lambda t: round((t - t0) * 1e6, 1)  # noqa: E731 - microseconds since the run began
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "raypp pipeline"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "driver"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": 0, "args": {"sort_index": 0}},
    ]
    for k in range(tl.num_stages):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": k + 1,
                       "args": {"name": f"stage {k}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": k + 1,
                       "args": {"sort_index": k + 1}})
    for kind, step_id, start, end in tl.driver:
        events.append({"name": f"{kind} step {step_id}", "cat": f"driver.{kind}", "ph": "X",
                       "pid": 1, "tid": 0, "ts": us(start), "dur": us(end) - us(start),
                       "args": {"step_id": step_id}})
    for stage, step_id, start, end in tl.compute:
        info = tl.steps.get(step_id, {})
        events.append({"name": f"step {step_id}", "cat": "compute", "ph": "X", "pid": 1,
                       "tid": stage + 1, "ts": us(start), "dur": us(end) - us(start),
                       "args": {"step_id": step_id, **info}})
    for stage, op, peer, start, end, nbytes in tl.comm:
        arrow = "→" if op == "send" else "←"
        events.append({"name": f"{op} {arrow} stage {peer}", "cat": f"comm.{op}", "ph": "X",
                       "pid": 1, "tid": stage + 1, "ts": us(start), "dur": us(end) - us(start),
                       "args": {"peer": peer, "bytes": nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"stage_busy_share": tl.busy_shares(), "t0_unix_s": t0}}


# -- Gantt chart ------------------------------------------------------------------------------
def _steady_window(tl: Timeline, num_steps: int) -> tuple[float, float] | None:
    """A window around ``num_steps`` consecutive micro-batches in the middle of the run."""
    last = [c for c in tl.compute if c[0] == tl.num_stages - 1]
    if len(last) < num_steps + 2:
        return None
    last.sort(key=lambda c: c[2])
    mid = len(last) // 2
    lo, hi = last[max(0, mid - num_steps // 2)], last[min(len(last) - 1, mid + num_steps // 2)]
    first_start = min((c[2] for c in tl.compute if c[1] == lo[1]), default=lo[2])
    return first_start, hi[3]


def _draw(ax: Any, tl: Timeline, t0: float, window: tuple[float, float] | None) -> None:
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    rows = ["driver"] + [f"stage {k}" for k in range(tl.num_stages)]
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    ms = lambda t: (t - t0) * 1e3  # noqa: E731

    def bars(items: list[tuple[float, float]], row: str, height: float, **kw: Any) -> None:
        if items:
            ax.broken_barh([(ms(s), ms(e) - ms(s)) for s, e in items],
                           (y[row] - height / 2, height), **kw)

    for kind, color in (("wait", "#d9d9d9"), ("submit", "#555555")):
        bars([(s, e) for k, _, s, e in tl.driver if k == kind], "driver", 0.5, color=color)
    for k in range(tl.num_stages):
        for step_id, start, end in [(c[1], c[2], c[3]) for c in tl.compute if c[0] == k]:
            bars([(start, end)], f"stage {k}", 0.7, color=colors[step_id % len(colors)],
                 edgecolor="black", linewidth=0.3)
        bars([(c[3], c[4]) for c in tl.comm if c[0] == k and c[1] == "send"],
             f"stage {k}", 0.25, color="black")
        bars([(c[3], c[4]) for c in tl.comm if c[0] == k and c[1] == "recv"],
             f"stage {k}", 0.25, color="#9467bd")
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_xlabel("ms since start")
    if window is not None:
        ax.set_xlim(ms(window[0]), ms(window[1]))
    ax.grid(axis="x", alpha=0.3)


def plot_gantt(tl: Timeline, path: str | Path, title: str = "", zoom_steps: int = 12) -> Path:
    """A PNG Gantt chart: the whole run on top, a steady-state window below.

    Compute bars are coloured by micro-batch (step id), thin black bars are sends,
    thin purple bars receives, grey on the driver row is waiting for a result.
    White space on a stage row is a bubble.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = _steady_window(tl, zoom_steps)
    panels = 2 if window else 1
    fig, axes = plt.subplots(panels, 1, figsize=(14, 2.2 + 1.6 * panels * (tl.num_stages + 1) / 3),
                             squeeze=False)
    t0 = tl.start
    _draw(axes[0][0], tl, t0, None)
    busy = ", ".join(f"stage {k} {100 * b:.0f}%" for k, b in enumerate(tl.busy_shares()))
    axes[0][0].set_title(f"{title}\nwhole run; compute busy: {busy}".strip(), fontsize=10)
    if window:
        _draw(axes[1][0], tl, t0, window)
        axes[1][0].set_title(f"zoom: ~{zoom_steps} micro-batches mid-run (colour = micro-batch; "
                             "black = send, purple = recv, grey = driver waiting; white = idle)",
                             fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_paths(out: str | Path) -> tuple[Path, Path]:
    """``(trace.json, chart.png)`` for ``--timeline OUT`` (OUT with or without a suffix)."""
    out = Path(out)
    base = out.with_suffix("") if out.suffix in (".json", ".png") else out
    return base.with_suffix(".json"), base.with_suffix(".png")


def write_timeline(tl: Timeline, out: str | Path, title: str = "") -> tuple[Path, Path]:
    """Write the Chrome trace and the PNG; returns both paths."""
    import json

    trace_path, png_path = timeline_paths(out)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path.write_text(json.dumps(to_chrome_trace(tl)))
    plot_gantt(tl, png_path, title)
    return trace_path, png_path
