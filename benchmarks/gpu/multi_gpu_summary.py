"""The multi-GPU suites' verdicts and ``summary.md``: targets (measured, met?) from the
results, then tables of communicators, throughput and hop latency. Works on partial
results (sections that failed or were skipped are left out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met?) rows for the summary."""
    rows: list[tuple[str, str, bool | None]] = []
    corr = results["correctness"]
    engines = results["engines"]
    fp32 = [(k, v["vs_reference"]) for k, v in corr.items() if "vs_reference" in v]
    if fp32:
        rows.append(("fp32 greedy == (1,1)", ", ".join(f"{k.split('/')[1]}: "
                     f"{'equal' if c['equal'] else 'DIFF at ' + str(c['first_diff'])}"
                     for k, c in fp32), all(c["ok"] for _, c in fp32)))
    bf16 = [(k, v["vs_reference"]) for k, v in engines.items() if "vs_reference" in v]
    if bf16:
        rows.append(("bf16 within tolerance of (1,1)", ", ".join(
            f"{k}: {'equal' if c['equal'] else 'max |Δlp| ' + str(c['max_abs_logprob_diff'])}"
            for k, c in bf16), all(c["ok"] for _, c in bf16)))
    hop = results.get("hop") or {}
    for n, d in (hop.get("derived") or {}).items():
        if "wrapped_le_native" in d:
            rows.append((f"hop {n} rows: wrapped ≤ native", f"{d['wrapped_step_p50_us']} vs "
                         f"{d['native_step_p50_us']} µs/step", d["wrapped_le_native"]))
        if "wrapped_over_raw_us" in d:
            rows.append((f"hop {n} rows: wrapped − raw ≤ 40 µs", f"{d['wrapped_over_raw_us']} µs",
                         d["wrapped_over_raw_us"] <= 40))
    tp = {k: v["throughput"] for k, v in engines.items() if "throughput" in v}
    for name, t in tp.items():
        if "pp2" in name and "inflight2" in name and t.get("stage_bound"):
            share = t["stage_bound"]["share_of_ideal"]
            rows.append((f"{name}: ≥ 0.9 × stage-bound ideal", f"{share}", share >= 0.9))
    if results["suite"] == "tp2pp2" and {"tp2pp2_wrapped_inflight2", "tp4pp1_inflight1",
                                         "tp1pp4_wrapped_inflight4"} <= tp.keys():
        best = max(tp["tp4pp1_inflight1"]["output_tokens_per_s"],
                   tp["tp1pp4_wrapped_inflight4"]["output_tokens_per_s"])
        mine = tp["tp2pp2_wrapped_inflight2"]["output_tokens_per_s"]
        rows.append(("(2,2) ≥ 0.9 × best of (4,1), (1,4)", f"{mine:.1f} vs {best:.1f} tok/s",
                     mine >= 0.9 * best))
    rows += _comm_targets(results)
    return rows


def _startup_comms(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """layout → its last communicator report (fp32 correctness or bf16 engine)."""
    out = {}
    for v in results["correctness"].values():
        if v.get("communicators"):
            out[f"fp32 {v['layout']}"] = v["communicators"][-1]
    for v in results["engines"].values():
        if v.get("communicators"):
            out[f"{v['dtype']} {v['layout']}"] = v["communicators"][-1]
    return out


def _comm_targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    rows: list[tuple[str, str, bool | None]] = []
    for name, rep in _startup_comms(results).items():
        if "pp1" in name:
            continue
        ray_created = rep["graph"]["ray_created"]
        if "native" not in name:
            rows.append((f"{name}: Ray created no communicator", str(ray_created) or "[]",
                         not ray_created))
    engines = results["engines"]
    w, n = engines.get("tp1pp2_wrapped_inflight2"), engines.get("tp1pp2_native_inflight2")
    if w and n and w.get("communicators") and n.get("communicators") \
            and results["device"] == "cuda":
        cw = sum(w["communicators"][-1]["nccl_comms_per_worker"])
        cn = sum(n["communicators"][-1]["nccl_comms_per_worker"])
        rows.append(("wrapped: fewer NCCL communicators than native", f"{cw} vs {cn}", cw < cn))
        mw = max(x["memory"]["gpu_used_gib"] for x in w["communicators"][0]["workers"])
        mn = max(x["memory"]["gpu_used_gib"] for x in n["communicators"][0]["workers"])
        rows.append(("wrapped: no more GPU memory after start-up", f"{mw} vs {mn} GiB",
                     mw <= mn))
    return rows


def summary_markdown(results: dict[str, Any]) -> str:
    ctx, machine = results.get("context", {}), results.get("machine", {})
    lines = [f"# raypp multi-GPU suite `{results['suite']}` — {results['kind']}", "",
             f"- command: `{results['command']}`",
             f"- machine: {machine.get('cpus')} CPUs; GPUs: "
             f"{machine.get('gpus', 'none').replace(chr(10), '; ')}",
             f"- software: Ray {ctx.get('ray')}, torch {ctx.get('torch')}, "
             f"Python {ctx.get('python')}; {ctx.get('time', '')}",
             f"- models: {results.get('models', {})}",
             f"- total {results.get('total_s', '?')} s; section times {results['timings_s']}", ""]
    if results["device"] != "cuda":
        lines += ["> **CPU dry run** over gloo with tiny models: it proves the script and the "
                  "checks, not GPU performance. Numbers below are not GPU results.", ""]
    lines += ["## Targets", "", "| target | measured | met? |", "| --- | --- | --- |"]
    for target, measured, ok in targets(results):
        lines.append(f"| {target} | {measured} | {'yes' if ok else 'no' if ok is False else '–'} |")
    lines += ["", "## Communicators (last report per engine)", "",
              "| engine | Ray-created | channel communicators per worker | "
              "NCCL comms / gloo groups per worker | memory per worker after start-up |",
              "| --- | --- | --- | --- | --- |"]
    for name, rep in _startup_comms(results).items():
        per = rep.get("nccl_comms_per_worker", rep.get("gloo_groups_per_worker"))
        chans = [w["channel_communicators"] for w in rep["workers"]]
        mem = [next(iter(w["memory"].values())) for w in rep["workers"]]
        lines.append(f"| {name} | {rep['graph']['ray_created']} | {chans} | {per} | {mem} |")
    lines += _throughput_lines(results) + _hop_lines(results)
    if results["errors"] or results["skipped"]:
        lines += ["", "## Errors and skipped sections", ""]
        lines += [f"- **{k}**: `{v.splitlines()[0]}`" for k, v in results["errors"].items()]
        lines += [f"- skipped: {s}" for s in results["skipped"]]
    return "\n".join(lines) + "\n"


def _throughput_lines(results: dict[str, Any]) -> list[str]:
    lines = ["", "## Throughput (`raypp bench throughput` runner)", "",
             "| engine | output tok/s | ms/step | steps | stage busy (per worker) | "
             "share of stage-bound "
             "ideal | start-up s |", "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, e in results["engines"].items():
        if "throughput" not in e:
            continue
        t = e["throughput"]
        # the timeline sums a stage's TP ranks; per worker is that over tp
        busy = [round(b / e["tp"], 3) for b in t.get("stage_busy_share", [])]
        lines.append(f"| {name} | {t['output_tokens_per_s']:.1f} | {t['mean_step_ms']:.2f} | "
                     f"{t['engine_steps']} | {busy} | "
                     f"{t['stage_bound'].get('share_of_ideal')} | {e['startup_s']} |")
    tl = [e["throughput"].get("timeline") for e in results["engines"].values()
          if "throughput" in e]
    lines += [f"\nTimeline: `{Path(t['png']).name}` (Chrome trace `{Path(t['chrome_trace']).name}`)"
              for t in tl if t]
    return lines


def _hop_lines(results: dict[str, Any]) -> list[str]:
    hop = results.get("hop")
    if not hop:
        return []
    lines = ["", f"## Hop latency ({hop['hidden']} wide, bf16; p50 / p90 ms per step)", "",
             "| rows | wrapped | native | one-stage graph | raw send/recv one-way | "
             "wrapped hop − raw (µs) | native hop − raw (µs) |",
             "| ---: | --- | --- | --- | --- | ---: | ---: |"]
    rows = hop["rows"]

    def cell(label: str, n: str, key: str) -> str:
        r = rows.get(label, {}).get(n, {}).get(key)
        return f"{r['p50_ms']:.3f} / {r['p90_ms']:.3f}" if r else "–"

    for n in sorted({n for r in rows.values() for n in r}, key=int):
        d = hop["derived"].get(n, {})
        lines.append(f"| {n} | {cell('wrapped', n, 'step')} | {cell('native', n, 'step')} | "
                     f"{cell('one_stage', n, 'step')} | {cell('raw', n, 'one_way')} | "
                     f"{d.get('wrapped_over_raw_us', '–')} | {d.get('native_over_raw_us', '–')} |")
    if hop["errors"]:
        lines += [f"\nHop errors: {hop['errors']}"]
    return lines
