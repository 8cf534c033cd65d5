"""The decode stage in-process (no Ray): per-step time split into graph replay (LM head
inside), staging and sampling; one step vs ``MULTI_STEPS`` per call; graphs vs eager;
the fused chain vs the compiled forward; and the HBM roofline of each batch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cuda_timing import time_cuda
from benchmarks.gpu.decode_engine import graphs_summary
from benchmarks.gpu.decode_profile import profiles
from benchmarks.gpu.decode_workload import BATCHES, MAX_MODEL_LEN, MULTI_STEPS, PROMPT_LEN, random_prompts
from benchmarks.gpu.stage_harness import StageHarness
from benchmarks.harness import Run, log


def stage_bench(ckpt: Path, run: Run, weight_bytes: int, bw: float) -> dict[str, Any]:
    """Per batch size, the stage's step times and roofline fractions (``bw``: copy GB/s),
    then a kernel profile (:func:`~benchmarks.gpu.decode_profile.profiles`) if time allows."""
    h = StageHarness(ckpt, max(BATCHES), max(BATCHES) * (-(-MAX_MODEL_LEN // 16)))
    res: dict[str, Any] = {"graphs": graphs_summary(h.worker)}
    try:
        for batch in BATCHES:
            if run.left() < 30:
                res[f"b{batch}"] = "skipped: time"
                continue
            res[f"b{batch}"] = _stage_batch(h, batch, weight_bytes, bw)
            log(f"stage b={batch}: {res[f'b{batch}']}")
        if run.left() > 40:
            res["profile"] = profiles(h, run)
    finally:
        h.shutdown()
    return res


def _stage_batch(h: StageHarness, batch: int, weight_bytes: int, bw: float) -> dict[str, Any]:
    from raypp.worker.sampler import sample

    w = h.worker
    runner = w.runner
    prompts = random_prompts(batch, PROMPT_LEN, 100 + batch)
    tokens = h.prefill(prompts)
    lengths = [PROMPT_LEN] * batch
    steps = 64
    walls = []
    torch.cuda.synchronize()
    for i in range(steps):  # full stage steps: staging, replay (LM head inside), sampling, tolist
        t = time.perf_counter()
        tokens, lengths = h.decode(tokens, lengths, i + 1)
        walls.append(time.perf_counter() - t)
    ctx = lengths[0]  # the roofline's context: where the timed steps ended
    tokens, lengths = h.decode(tokens, lengths, steps + 1, MULTI_STEPS)  # warm
    t = time.perf_counter()
    tokens, lengths = h.decode(tokens, lengths, steps + 1 + MULTI_STEPS, MULTI_STEPS)
    multi = (time.perf_counter() - t) / MULTI_STEPS
    step = h.decode_step(tokens, lengths, steps + 1 + 2 * MULTI_STEPS)
    graphs = runner.graphs
    g = graphs.graph_size(batch)
    with torch.inference_mode():
        fwd = time_cuda(lambda: graphs.run(step, None), 20)  # staging copies + replay
        replay = time_cuda(graphs._graphs[g].replay, 20)
        logits = graphs.run(step, None)
        sampling = time_cuda(lambda: sample(logits, step.sampling), 20)
        runner.graphs = None  # the eager forward and LM head on the same step
        try:
            eager = time_cuda(lambda: runner._logits(step, None), 10)
        finally:
            runner.graphs = graphs
        unfused = _unfused_replay(w, step) if g in graphs.fused_sizes else None
    walls.sort()
    wall = walls[len(walls) // 2]
    kv_bytes = batch * ctx * _kv_bytes_per_token(runner.kv_caches)
    roof = (weight_bytes + kv_bytes) / (bw * 1e9)
    return {
        "step_ms": round(1e3 * wall, 3),
        "tok_s": round(batch / wall, 1),
        f"multi_step_{MULTI_STEPS}_ms_per_step": round(1e3 * multi, 3),
        f"multi_step_{MULTI_STEPS}_tok_s": round(batch / multi, 1),
        "graph_replay_with_lm_head_ms": round(1e3 * replay, 3),
        "graph_replay_unfused_ms": unfused and round(1e3 * unfused, 3),
        "forward_ms(staging+replay)": round(1e3 * fwd, 3),
        "sample_ms": round(1e3 * sampling, 3),
        "eager_forward_and_head_ms": round(1e3 * eager, 3),
        "padded_to": g,
        "context": ctx,
        "bytes_per_step": weight_bytes + kv_bytes,
        "roofline_ms": round(1e3 * roof, 3),
        "roofline_fraction_step": round(roof / wall, 3),
        "roofline_fraction_multi_step": round(roof / multi, 3),
        "roofline_fraction_replay": round(roof / replay, 3),
    }


def _unfused_replay(w: Any, step: Any) -> float:
    """Replay seconds of the compiled forward's graph (what batch 1 captured before the
    fused chain, ``fused_decode_max_rows=0``) on the same step, weights and caches."""
    from raypp.worker.cuda_graphs import DecodeGraphs

    g = w.decode_graphs
    other = DecodeGraphs(w.model, w.runner.kv_caches, is_first=g.is_first, is_last=g.is_last,
                         max_num_seqs=step.num_seqs, max_blocks_per_seq=g.buffers.width,
                         hidden_size=w.config.model.hidden_size, dtype=w.config.model.torch_dtype,
                         device=w.device, sizes=[step.num_seqs], fused_max_rows=0).capture()
    other.load(step)
    seconds = time_cuda(other._graphs[step.num_seqs].replay, 20)
    del other
    return seconds


def _kv_bytes_per_token(kv_caches: list[torch.Tensor]) -> int:
    """KV bytes one token takes over all layers (caches ``[2, blocks, block, kv_heads, dim]``)."""
    cache = kv_caches[0]
    per_layer = 2 * cache.shape[3] * cache.shape[4] * cache.element_size()
    return per_layer * len(kv_caches)
