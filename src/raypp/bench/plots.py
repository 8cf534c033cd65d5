"""``--plot OUT.png`` of every ``raypp bench`` command, drawn from its result dictionary.

Each function writes one PNG with matplotlib's Agg canvas (no pyplot, no display, no
global backend switch) and returns its path; parent directories are created.

- :func:`plot_throughput`: output and total tokens/s, raypp beside transformers
  when ``--compare-hf`` ran, with the ratio in the title.
- :func:`plot_latency`: every engine step's wall time against its index in the batch,
  prefill, decode and idle steps apart.
- :func:`plot_serve`: TTFT and TPOT p50/p99, and goodput beside request throughput,
  against the request rate (or the concurrency of a closed-loop run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_KIND_COLORS = {"prefill": "tab:red", "decode": "tab:blue", "idle": "tab:gray"}


def _figure(width: float, height: float, cols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, cols, i + 1) for i in range(cols)]


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    return path


def plot_throughput(result: dict[str, Any], path: str | Path) -> Path:
    """Bars of output and total tokens/s: raypp, and transformers when compared."""
    fig, (ax,) = _figure(6.5, 4.0)
    metrics = [("output_tokens_per_s", "output tok/s"), ("total_tokens_per_s", "total tok/s")]
    systems = [("raypp", result, "tab:blue")]
    if "transformers" in result:
        hf = result["transformers"]
        systems.append((f"transformers ({hf['cache']} cache)", hf, "tab:orange"))
    width = 0.8 / len(systems)
    for k, (name, numbers, color) in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(metrics))]
        bars = ax.bar(xs, [numbers[key] for key, _ in metrics], width, label=name, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(metrics)), [label for _, label in metrics])
    ax.set_ylabel("tokens / s")
    ax.legend(loc="upper left", fontsize=8)
    title = (f"raypp bench throughput: {result['num_requests']} requests, "
             f"pp={result['pipeline_parallel_size']}, {result['device']}")
    if "vs_transformers" in result:
        title += f"\nraypp / transformers = {result['vs_transformers']['output_tokens_per_s']['ratio']:.2f}x"
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_latency(result: dict[str, Any], path: str | Path) -> Path:
    """Each step's wall time (ms) against its index in the batch, coloured by kind."""
    fig, (ax,) = _figure(7.5, 4.0)
    rows = result["steps"]
    for kind, color in _KIND_COLORS.items():
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            ax.scatter([r["index"] for r in mine], [r["wall_ms"] for r in mine], s=14,
                       color=color, label=f"{kind} ({len(mine)})", alpha=0.7)
    by_index: dict[int, list[float]] = {}
    for r in rows:
        by_index.setdefault(r["index"], []).append(r["wall_ms"])
    xs = sorted(by_index)
    ax.plot(xs, [float(np.median(by_index[x])) for x in xs], color="black", lw=0.8,
            label="median over batches")
    ax.set_xlabel("engine step in the batch")
    ax.set_ylabel("step wall time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"raypp bench latency: batch of {result['batch_size']}, "
                 f"{result['num_iters']} batches, pp={result['pipeline_parallel_size']}, "
                 f"{result['device']}", fontsize=9)
    return _save(fig, path)


def run_label(run: dict[str, Any]) -> str:
    """A serve run's x-axis label: its request rate (a number, or ``"inf"``), or its
    concurrency."""
    rate = run.get("request_rate")
    if rate is None:
        return f"c={run['concurrency']}"
    return rate if isinstance(rate, str) else f"{rate:g}"


def plot_serve(result: dict[str, Any], path: str | Path) -> Path:
    """TTFT/TPOT p50 and p99 (left) and goodput beside request throughput (right)."""
    runs = result.get("runs") or [result]
    fig, (lat, rate) = _figure(11.0, 4.0, cols=2)
    xs = list(range(len(runs)))
    labels = [run_label(r) for r in runs]
    for key, name, color in (("ttft_ms", "TTFT", "tab:red"), ("tpot_ms", "TPOT", "tab:blue")):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            lat.plot(xs, [r[key].get(q, float("nan")) for r in runs], style, color=color,
                     label=f"{name} {q}")
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.legend(fontsize=8)
    width = 0.38
    done = rate.bar([x - width / 2 for x in xs], [r["requests_per_s"] for r in runs], width,
                    label="completed req/s", color="tab:gray")
    good = rate.bar([x + width / 2 for x in xs], [r["goodput_requests_per_s"] for r in runs],
                    width, label="goodput req/s", color="tab:green")
    rate.bar_label(done, fmt="%.2f", fontsize=7)
    rate.bar_label(good, fmt="%.2f", fontsize=7)
    rate.set_ylabel("requests / s")
    rate.legend(fontsize=8)
    xlabel = "request rate (req/s)" if runs[0].get("request_rate") is not None else "clients"
    for ax in (lat, rate):
        ax.set_xticks(xs, labels)
        ax.set_xlabel(xlabel)
    slo = result.get("slo") or {}
    bounds = ", ".join(f"{k} <= {v:g} ms" for k, v in (("TTFT", slo.get("ttft_ms")),
                                                         ("TPOT", slo.get("tpot_ms"))) if v)
    fig.suptitle(f"raypp bench serve: {result['config']['model']}, "
                 f"{result['config']['max_tokens']} tokens a request; goodput SLO: "
                 f"{bounds or 'none (every completed request)'}", fontsize=9)
    return _save(fig, path)
