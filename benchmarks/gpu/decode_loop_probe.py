"""Where a multi-step decode round's time goes beyond its graph replays (GPU).

    PYTHONPATH=src python3 -m benchmarks.gpu.decode_loop_probe --out DIR [--ckpt DIR]

(from the repository root; formerly ``scripts/decode_loop_probe.py``).
On the decode benchmark's 1B checkpoint (built if missing), with one ``StageWorker`` in
this process (:class:`~benchmarks.gpu.stage_harness.StageHarness`), at batch 1 and 64
(context ~600), per decode step: an isolated graph replay (as :mod:`benchmarks.gpu.decode`'s
``graph_replay_with_lm_head_ms``), replays back to back, replays
each followed by the greedy kernels (argmax + advance: what a greedy round runs),
the same loop over 256 steps (first and last 32 apart, for clock drift), and a
whole round through ``execute_step``. GPU clocks and power come from NVML where
available. Writes ``decode_loop_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.decode_workload import MAX_MODEL_LEN, PROMPT_LEN, make_checkpoint, random_prompts
from benchmarks.gpu.stage_harness import StageHarness
from benchmarks.harness import add_run_args


def _events(n: int) -> list[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _nvml() -> dict[str, Any]:
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(), "power_w": torch.cuda.power_draw() / 1e3}
    except Exception as e:  # noqa: BLE001 - NVML missing: the timings stand alone
        return {"nvml": str(e)}


def probe_batch(h: StageHarness, batch: int) -> dict[str, Any]:
    """The probe's timings at ``batch`` (see the module docstring)."""
    from raypp.kernels.sampling import EMPTY_KEY, greedy_step

    w = h.worker
    graphs = w.decode_graphs
    tokens = h.prefill(random_prompts(batch, PROMPT_LEN, 7 + batch))
    lengths = [PROMPT_LEN] * batch
    tokens, lengths = h.decode(tokens, lengths, 1, 32)  # warm, context 544
    out: dict[str, Any] = {}
    with torch.inference_mode():
        step = h.decode_step(tokens, lengths, 40)
        inputs = graphs.load(step)
        g = graphs.graph_size(batch)
        replay = graphs._graphs[g].replay
        iso = []
        for _ in range(20):
            a, b = _events(2)
            a.record()
            replay()
            b.record()
            b.synchronize()
            iso.append(a.elapsed_time(b))
        out["isolated_replay_ms"] = round(sorted(iso)[10], 4)
        a, b = _events(2)
        a.record()
        for _ in range(32):
            replay()
        b.record()
        b.synchronize()
        out["back_to_back_replay_ms"] = round(a.elapsed_time(b) / 32, 4)

        keys = torch.full((batch,), EMPTY_KEY, dtype=torch.int64, device="cuda")
        res = torch.empty(batch, 256, dtype=torch.int64, device="cuda")
        a, b = _events(2)
        a.record()
        for j in range(32):  # argmax only: the inputs stay put
            greedy_step(graphs.replay(), keys, res[:, j], None, h.block_size)
        b.record()
        b.synchronize()
        out["replay_argmax_ms"] = round(a.elapsed_time(b) / 32, 4)

        inputs = graphs.load(h.decode_step(tokens, lengths, 41))
        marks = _events(257)
        before = _nvml()
        host = time.perf_counter()
        marks[0].record()
        for j in range(256):  # what a greedy round runs: the inputs advance every step
            greedy_step(graphs.replay(), keys, res[:, j], inputs, h.block_size)
            marks[j + 1].record()
        host = time.perf_counter() - host
        mid = _nvml()
        marks[-1].synchronize()
        per = [marks[j].elapsed_time(marks[j + 1]) for j in range(256)]
        out["loop_first_32_ms"] = round(sum(per[:32]) / 32, 4)
        out["loop_last_32_ms"] = round(sum(per[-32:]) / 32, 4)
        out["loop_256_ms"] = round(sum(per) / 256, 4)
        out["loop_host_launch_ms_per_step"] = round(1e3 * host / 256, 4)
        out["nvml_before_loop"], out["nvml_end_of_launches"] = before, mid
        lengths = [c + 256 for c in lengths]
        tokens = res[:, 255].tolist()
        t = time.perf_counter()
        h.decode(tokens, lengths, 400, 32)
        out["execute_step_32_ms_per_step"] = round(1e3 * (time.perf_counter() - t) / 32, 4)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.decode_loop_probe",
                                 description=__doc__.split("\n")[0])
    add_run_args(ap, out_default="probe_out")
    ap.add_argument("--ckpt", default="/tmp/raypp-llama-1b-random",
                    help="the decode benchmark's checkpoint (built here if missing)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt)
    h = StageHarness(ckpt, 64, 64 * (-(-MAX_MODEL_LEN // 16)))
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    try:
        for batch in (1, 64):
            results[f"b{batch}"] = probe_batch(h, batch)
            print(batch, results[f"b{batch}"], flush=True)
            (out / "decode_loop_probe.json").write_text(json.dumps(results, indent=1))
    finally:
        h.shutdown()


if __name__ == "__main__":
    main()
