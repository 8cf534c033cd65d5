"""Small helpers every benchmark shares: percentiles, tables, JSON files, run context."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation; ``nan`` when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"n", "mean", "p50", "p90", "p99", "min", "max"}`` of ``values``."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (floats to 2 decimals)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def run_context() -> dict[str, Any]:
    """Where and how a benchmark ran, recorded beside its numbers."""
    import ray
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["raypp", *sys.argv[1:]]) if sys.argv else "",
        "host_cpus": os.cpu_count(),
        "load_avg_at_end": load,
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
    }


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` as indented JSON (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
