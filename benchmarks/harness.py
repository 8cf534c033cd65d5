"""What every lab script shares: sections under one time budget, a ``results.json``
rewritten after each, the command-line options for that, logging, and what machine
the numbers came from.

A script makes one :class:`Run` and calls :meth:`Run.section` once per section. A
caller may rely on this:

- a section that is not selected, or that needs more time than is left, does not
  run; one skipped for time is always listed in ``results["skipped"]`` (``"NAME: N s
  left, needs ~M"``), one not selected only when the run says so;
- an exception in a section is recorded as ``results["errors"][NAME]`` (type,
  message, traceback) and the run goes on with the next section;
- each section's wall time lands in ``results["timings_s"][NAME]``;
- after every section (run, failed or skipped for time) ``results.json`` and the
  run's summary files are rewritten, so a run cut short still reports.

Nothing here touches CUDA except :func:`cuda_card`: the multi-GPU driver must not
hold a CUDA context on a stage's GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    """One timestamped line on stdout, flushed (the device call's log keeps the order)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """One script run: its results, output folder and deadline.

    ``select(name)`` says whether a section runs (default: all); with
    ``note_unselected`` a section it rejects is listed as ``"NAME: not selected by
    --only"``. ``cleanup`` runs after every section that ran (e.g.
    ``torch.cuda.empty_cache``). ``summaries`` maps a file name to a function of the
    results whose text is written next to ``results.json`` on every save; a failing
    summary is logged, never raised.
    """

    def __init__(self, out: Path, budget_s: float, results: dict[str, Any] | None = None, *,
                 select: Callable[[str], bool] | None = None, note_unselected: bool = False,
                 cleanup: Callable[[], None] | None = None,
                 summaries: dict[str, Callable[[dict[str, Any]], str]] | None = None):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + budget_s
        self.results: dict[str, Any] = results if results is not None else {}
        for key, empty in (("errors", {}), ("skipped", []), ("timings_s", {})):
            self.results.setdefault(key, empty)
        self._select = select or (lambda _name: True)
        self._note_unselected = note_unselected
        self._cleanup = cleanup
        self._summaries = summaries or {}

    def left(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.deadline - time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.t0

    def save(self) -> None:
        """Rewrite ``results.json`` and every summary file."""
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        for name, render in self._summaries.items():
            try:
                (self.out / name).write_text(render(self.results))
            except Exception as e:  # noqa: BLE001 - a partial result must not stop the run
                log(f"!! {name}: {type(e).__name__}: {e}")

    def section(self, name: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        """``fn()``'s value, or ``None`` when it was skipped or raised (see the module)."""
        if not self._select(name):
            if self._note_unselected:
                self.results["skipped"].append(f"{name}: not selected by --only")
            return None
        if self.left() < need_s:
            self.results["skipped"].append(f"{name}: {self.left():.0f} s left, needs ~{need_s:.0f}")
            log(f"== {name}: skipped ({self.left():.0f} s left)")
            self.save()
            return None
        log(f"== {name} ({self.left():.0f} s left)")
        started = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - record and go on with the next section
            self.results["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            log(f"!! {name} failed: {type(e).__name__}: {e}")
            return None
        finally:
            self.results["timings_s"][name] = round(time.perf_counter() - started, 1)
            gc.collect()
            if self._cleanup is not None:
                self._cleanup()
            self.save()


# -- command line ------------------------------------------------------------------------------
def add_run_args(parser: argparse.ArgumentParser, *, out_default: str | None,
                 budget_s: float | None = None, budget_help: str | None = None,
                 sections: bool = False) -> None:
    """``--out`` (required when ``out_default`` is ``None``), ``--budget-s`` (when
    ``budget_s`` is given: its default) and ``--sections`` (exact section names,
    comma-separated; read with :func:`parse_sections`)."""
    parser.add_argument("--out", default=out_default, required=out_default is None,
                        help="folder for the results (created if missing)")
    if budget_s is not None:
        parser.add_argument("--budget-s", type=float, default=budget_s,
                            help=budget_help or "skip sections that would not finish within "
                                                "this many seconds")
    if sections:
        parser.add_argument("--sections", default=None,
                            help="comma-separated sections to run (default: all)")


def parse_sections(text: str | None) -> list[str] | None:
    """``"a, b"`` → ``["a", "b"]``; ``None`` or empty → ``None`` (every section)."""
    names = [x.strip() for x in (text or "").split(",") if x.strip()]
    return names or None


# -- the machine -------------------------------------------------------------------------------
def software_versions() -> dict[str, str | None]:
    """Versions of torch, transformers, Triton, Ray (``None`` where not installed) and Python."""
    import importlib

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "triton", "ray"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def cuda_card(index: int = 0) -> dict[str, Any]:
    """The GPU's name and SM count, as CUDA reports them (creates a CUDA context)."""
    import torch

    return {"gpu": torch.cuda.get_device_name(index),
            "sms": torch.cuda.get_device_properties(index).multi_processor_count}


def machine_info(device: str) -> dict[str, Any]:
    """CPUs, and on CUDA the GPUs (from ``nvidia-smi``, so no CUDA context), their
    topology and the NCCL / multicast settings in force."""
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    if device != "cuda":
        return info
    for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                               "--format=csv,noheader"]), ("topology", ["nvidia-smi", "topo", "-m"])):
        try:
            info[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info[key] = f"{type(e).__name__}: {e}"
    info["env"] = {k: v for k, v in os.environ.items()
                   if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE"))}
    return info
