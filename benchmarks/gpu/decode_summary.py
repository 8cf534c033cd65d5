"""The decode benchmark's closing table (``summary.txt``): decode tokens/s per batch for
every engine and stage run, the transformers peer and the roofline, then the A/B lines,
correctness, errors and skipped sections. Missing sections print as ``-``."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.decode_workload import BATCHES, DECODE_STEPS, MULTI_STEPS, SYNC_AB_BATCHES, SYNC_AB_STEPS


def summary(r: dict[str, Any]) -> str:
    """The table of the results ``r`` (as written to ``results.json``)."""
    lines = []
    bw = r.get("bandwidth") or {}
    lines.append(f"GPU {r['env'].get('gpu')}: copy {bw.get('copy_GBps', 0):.0f} GB/s, "
                 f"read {bw.get('read_GBps', 0):.0f} GB/s")
    eng, stage = r.get("raypp_engine") or {}, r.get("raypp_stage") or {}
    hfe, hfs = r.get("hf_eager") or {}, r.get("hf_static_compile") or {}

    def get(d: dict, key: str, field: str) -> float | None:
        v = d.get(key)
        return float(v[field]) if isinstance(v, dict) and field in v else None

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    engines = [f"engine k={k}" for k in DECODE_STEPS]
    lines.append("decode tok/s batch | " + " | ".join(engines) + " | stage k=1 | stage k="
                 f"{MULTI_STEPS} | HF eager | HF static+compile | best engine/HF best | roofline")
    for b in BATCHES:
        hf_best = max([x for x in (get(hfe, f"b{b}", "decode_tok_s"),
                                   get(hfs, f"b{b}", "decode_tok_s")) if x] or [0.0])
        runs = [get(eng, f"b{b}" + ("" if k == 1 else f"_k{k}"), "decode_tok_s")
                for k in DECODE_STEPS]
        best = max([x for x in runs if x] or [0.0])
        ratio = f"{best / hf_best:.1f}x" if best and hf_best else "-"
        roof = get(stage, f"b{b}", "roofline_ms")
        lines.append(f"{b:>18} | " + " | ".join(f"{fmt(x):>{len(e)}}" for x, e in zip(runs, engines))
                     + f" | {fmt(get(stage, f'b{b}', 'tok_s')):>9} | "
                     f"{fmt(get(stage, f'b{b}', f'multi_step_{MULTI_STEPS}_tok_s')):>10} | "
                     f"{fmt(get(hfe, f'b{b}', 'decode_tok_s')):>8} | "
                     f"{fmt(get(hfs, f'b{b}', 'decode_tok_s')):>17} | {ratio:>19} | "
                     f"{fmt(b / roof * 1e3 if roof else None):>8}")
        if b == 1 and roof:
            fastest = max((x for x in runs if x), default=None)
            lines.append(f"batch 1: roofline {roof:.3f} ms/step; best engine "
                         f"{100 * fastest * roof / 1e3:.1f}% of it" if fastest else "")
    direct = r.get("raypp_engine_direct") or {}
    for b in SYNC_AB_BATCHES:
        runs = {k: get(direct, f"b{b}_k{k}", "decode_tok_s") for k in DECODE_STEPS[-2:]}
        if any(runs.values()):
            lines.append(f"batch {b}, direct control plane: " + ", ".join(
                f"k={k} {fmt(x)} tok/s" for k, x in runs.items()))
    k = SYNC_AB_STEPS
    for b in SYNC_AB_BATCHES:
        on, off = (get(eng, f"b{b}_k{k}" + s, "decode_tok_s") for s in ("", "_sync"))
        if on and off:
            lines.append(f"batch {b}, k={k}: async scheduling {on:.0f} tok/s, off {off:.0f} "
                         f"({on / off:.3f}x)")
    c = r.get("correctness") or {}
    if c:
        lines.append(f"fp32 greedy == HF: {c.get('fp32_greedy_equal')}; bf16 agreement "
                     f"{c.get('bf16_token_agreement_vs_hf_bf16')}, logprob rel err "
                     f"{(c.get('bf16_logprob_rel_err_vs_hf_bf16') or {}).get('rel')}")
    if r["errors"]:
        lines.append("errors in: " + ", ".join(r["errors"]))
    if r["skipped"]:
        lines.append("skipped: " + "; ".join(r["skipped"]))
    return "\n".join(lines)
