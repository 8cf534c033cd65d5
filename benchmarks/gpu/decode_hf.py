"""transformers on the same checkpoint: the peer's decode tokens/s (``generate``, eager or
static cache + ``torch.compile``), and its greedy tokens and logprobs for the checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.decode_workload import BATCHES, OUTPUT_LEN, PROMPT_LEN, random_prompts
from benchmarks.harness import Run, log


def hf_model(ckpt: Path, dtype: torch.dtype) -> Any:
    """The checkpoint as a transformers model on the GPU, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).cuda()
    model.eval()
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens after each prompt, one prompt at a time (no padding)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
        outs.append(gen[0, len(p):].tolist())
    return outs


@torch.inference_mode()
def hf_logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] float32 logprobs of each output position, teacher-forced."""
    ids = torch.tensor([prompt + output], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    return torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def hf_bench(ckpt: Path, run: Run, static: bool) -> dict[str, Any]:
    """transformers generate: eager (dynamic cache) or static cache (auto torch.compile).

    Decode time = full run − prefill-only run. Eager runs every batch size (64 output
    tokens outside batch 64: it is host-bound at a near-constant step time); static
    runs batch 64 then 1, each compiled first with the timed shapes.
    """
    model = hf_model(ckpt, torch.bfloat16)
    res: dict[str, Any] = {"mode": "static cache + torch.compile" if static else "eager, sdpa"}
    kw: dict[str, Any] = {"cache_implementation": "static"} if static else {}
    order = (64, 1) if static else BATCHES
    need = 100 if static else 15
    _hf_generate(model, random_prompts(1, 32, 3), 4, {})  # warm CUDA/cuBLAS
    for batch in order:
        if run.left() < need:
            res[f"b{batch}"] = "skipped: time"
            continue
        prompts = random_prompts(batch, PROMPT_LEN, 100 + batch)
        out_len = OUTPUT_LEN if static or batch == 64 else 64
        if static:  # compile with the same shapes as the timed run
            t = time.perf_counter()
            _hf_generate(model, prompts, out_len, kw)
            res[f"b{batch}_compile_and_first_run_s"] = round(time.perf_counter() - t, 1)
        _hf_generate(model, prompts, 1, kw)
        t_pre = min(_timed(_hf_generate, model, prompts, 1, kw) for _ in range(2))
        # the best of two full runs where one is short (static: ~2 s at batch 64), so
        # one slow run does not lower the peer's number
        t_all = min(_timed(_hf_generate, model, prompts, out_len, kw)
                    for _ in range(2 if static else 1))
        decode = max(t_all - t_pre, 1e-9)
        res[f"b{batch}"] = {
            "output_tokens": out_len, "total_s": round(t_all, 3), "prefill_s": round(t_pre, 3),
            "decode_tok_s": round(batch * (out_len - 1) / decode, 1),
            "decode_step_ms": round(1e3 * decode / (out_len - 1), 3),
            "e2e_output_tok_s": round(batch * out_len / t_all, 1),
        }
        log(f"hf {'static' if static else 'eager'} b={batch}: {res[f'b{batch}']}")
    return res


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _hf_generate(model: Any, prompts: list[list[int]], n: int, kw: dict) -> Any:
    ids = torch.tensor(prompts, device="cuda")
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
