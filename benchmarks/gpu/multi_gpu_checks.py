"""Correctness of the multi-GPU layouts against (1, 1): greedy tokens and top logprobs,
compared exactly (fp32) or up to near-ties (bf16); and the fp32 correctness sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.gpu.multi_gpu_comms import comm_report
from benchmarks.gpu.multi_gpu_engines import make_llm, shutdown
from benchmarks.gpu.multi_gpu_models import check_prompts
from benchmarks.gpu.multi_gpu_suites import BF16_TOLERANCE, LOGPROBS, REFERENCE, Layout, SuiteRun


def generate_check(llm: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Greedy tokens and top-``LOGPROBS`` logprobs per generated position."""
    from raypp import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            logprobs=LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{int(t): lp.logprob for t, lp in pos.items()}
                          for pos in o.outputs[0].logprobs] for o in outs]}


def compare(ref: dict[str, Any], got: dict[str, Any], exact: bool,
            tol: float = BF16_TOLERANCE) -> dict[str, Any]:
    """Tokens equal (``exact``), or equal up to near-ties with logprobs within ``tol``.

    Before the first differing token, every token both runs rank in their top-k
    must have logprobs within ``tol``; at a differing token, the reference must
    rank the other run's token within ``tol`` of its own (a near-tie).
    """
    first_diff, max_diff, ties = [], 0.0, []
    for ref_t, got_t, ref_lp, got_lp in zip(ref["tokens"], got["tokens"], ref["logprobs"],
                                           got["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(ref_t, got_t)) if a != b),
                 None if len(ref_t) == len(got_t) else min(len(ref_t), len(got_t)))
        first_diff.append(d)
        for i in range(len(ref_t) if d is None else d):
            common = ref_lp[i].keys() & got_lp[i].keys()
            max_diff = max([max_diff, *(abs(ref_lp[i][t] - got_lp[i][t]) for t in common)])
        if d is not None and d < min(len(ref_t), len(got_t)):
            own = ref_lp[d].get(ref_t[d], float("nan"))
            other = ref_lp[d].get(got_t[d])
            ties.append(float("inf") if other is None else own - other)
    equal = all(d is None for d in first_diff)
    ok = equal if exact else (max_diff <= tol and all(g <= tol for g in ties))
    return {"equal": equal, "ok": ok, "first_diff": first_diff,
            "max_abs_logprob_diff": round(max_diff, 6),
            "tie_gaps": [round(g, 4) for g in ties], "tolerance": None if exact else tol}


def correctness_fp32(run: SuiteRun, model: Path, layouts: list[Layout]) -> None:
    """fp32, eager (no CUDA graphs: a short run): each layout against (1, 1), one
    section per engine; results under ``run.results["correctness"]["fp32/<layout>"]``."""
    work, res = run.work, run.results["correctness"]
    prompts = None
    ref = None
    for layout in [REFERENCE, *layouts]:
        def one(layout: Layout = layout) -> None:
            nonlocal prompts, ref
            llm = make_llm(run.args, work, model, layout, "float32", eager=True)
            try:
                if prompts is None:
                    prompts = check_prompts(work, llm.engine.config.model.vocab_size)
                started = comm_report(llm, run.args.device, "after start-up")
                out = generate_check(llm, prompts, work.check_tokens)
                entry = {"layout": layout.name, "dtype": "float32",
                         "tokens": out["tokens"],
                         "communicators": [started, comm_report(llm, run.args.device,
                                                                "after generation")]}
                if layout == REFERENCE:
                    ref = out
                elif ref is not None:
                    entry["vs_reference"] = compare(ref, out, exact=True)
                res[f"fp32/{layout.name}"] = entry
            finally:
                shutdown(llm)
        run.section(f"correctness fp32 {layout.name}", one, need_s=30)
