"""What the CUDA test modules compare against, in one place: float64 errors and attention,
transformers on the GPU (greedy tokens, teacher-forced logprobs), and the check that a
stage's decode-graph replays give its eager forward's logits.

Imported only by ``tests/test_cuda*.py``; nothing here runs without a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

DEVICE = "cuda"
BLOCK_SIZE = 16  # the block size of the caches the graph checks build


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def pdl_modes() -> tuple[bool, ...]:
    """Both launch modes where the GPU has programmatic dependent launch, else without."""
    from raypp.kernels.tuning import pdl_supported

    return (False, True) if pdl_supported(torch.device(DEVICE)) else (False,)


def ref_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               window: int | None = None) -> torch.Tensor:
    """float64 attention of one query per sequence over the last ``window`` tokens of its
    cached context (all of it when ``window`` is None)."""
    seqs, heads, dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(seqs, heads, dim, dtype=torch.float64, device=q.device)
    for s in range(seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        first = 0 if window is None else max(0, n - window)
        blocks = tables[s, : -(-n // block_size)]
        keys = key_cache[blocks].reshape(-1, kv_heads, dim)[first:n].double()
        values = value_cache[blocks].reshape(-1, kv_heads, dim)[first:n].double()
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        p = (torch.einsum("hd,lhd->hl", q[s].double(), keys) * scale).softmax(-1)
        out[s] = torch.einsum("hl,lhd->hd", p, values)
    return out


# -- transformers on the GPU -----------------------------------------------------------------
def _hf_model(model_dir: str, dtype: torch.dtype) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE)


def hf_greedy_cuda(model_dir: Any, prompts: list[list[int]], max_tokens: int,
                   dtype: torch.dtype) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt, exactly ``max_tokens`` tokens,
    the end-of-sequence token an ordinary token (raypp's ``ignore_eos``). The argmax of
    transformers' logits one token at a time, with its cache: ``generate``'s
    ``min_new_tokens`` would instead forbid EOS, a different continuation wherever EOS
    is the argmax."""
    model = _hf_model(str(model_dir), dtype)
    outs = []
    for p in prompts:
        ids, cache, tokens = torch.tensor([p], device=DEVICE), None, []
        with torch.inference_mode():
            for _ in range(max_tokens):
                out = model(ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[tokens[-1]]], device=DEVICE)
        outs.append(tokens)
    return outs


def _teacher_forced(model_dir: str, prompts: list[list[int]], outs: list[Any],
                    dtype: torch.dtype, fp8: str | None = None) -> list[torch.Tensor]:
    """Per prompt: transformers' log-softmax at each of raypp's generated positions.
    ``fp8``: ``"kv"``, keys and values stored through an e4m3 cache (scale 1, raypp's
    ``kv_cache_dtype="fp8"``); ``"activations"``, every decoder linear's input rounded
    per token through e4m3 (raypp's W8A8 ``_scaled_mm``)."""
    from hf_reference import e4m3_kv_cache, round_linear_inputs_per_token

    model = _hf_model(model_dir, dtype)
    hooks = round_linear_inputs_per_token(model) if fp8 == "activations" else []
    refs = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out.token_ids[:-1]], device=DEVICE)
        kwargs = {"past_key_values": e4m3_kv_cache(model), "use_cache": True} if fp8 == "kv" else {}
        with torch.inference_mode():
            refs.append(model(ids, **kwargs).logits[0, len(prompt) - 1:].float().log_softmax(-1))
    for hook in hooks:
        hook.remove()
    return refs


def assert_logprobs_within_transformers_error(model_dir: Any, prompts: list[list[int]],
                                              outs: list[Any], dtype: torch.dtype,
                                              tie: float | None, label: str,
                                              fp8: str | None = None) -> None:
    """raypp's half-precision completions ``outs`` (with top logprobs), teacher-forced
    through transformers: raypp's logprobs are as close to transformers' fp32 as
    transformers' own ``dtype`` logprobs are (relative error at most 1.5x theirs, plus
    1e-3). With ``tie``: raypp's greedy tokens are *far* (more than ``tie`` nats below
    both transformers' ``dtype`` choice and its fp32 choice) at no more positions than
    transformers' own ``dtype`` choices are more than ``tie`` fp32 nats below its fp32
    choice. For a dense model that count is almost always 0, so every token must be
    close; an MoE router's near-ties let single positions of either dtype route to
    another expert and jump by a nat or more, and there transformers' own count is the
    allowance. ``fp8`` (see :func:`_teacher_forced`): raypp rounds through e4m3 where
    plain transformers does not, so the error allowed is that of transformers in ``dtype``
    doing the same rounding — the same arithmetic, written by others — still against
    plain fp32."""
    half = _teacher_forced(str(model_dir), prompts, outs, dtype, fp8)
    full = _teacher_forced(str(model_dir), prompts, outs, torch.float32)
    ours = theirs = norm = 0.0
    far: list[str] = []
    own_far = 0
    for n, (out, ref_half, ref) in enumerate(zip(outs, half, full, strict=True)):
        best = ref.max(-1).values
        if tie is not None:  # transformers' own dtype choices far below its fp32 ones
            own = ref.gather(-1, ref_half.argmax(-1, keepdim=True))[:, 0]
            own_far += int((best - own > tie).sum())
        for i, (tok, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            gap_half = (ref_half[i].max() - ref_half[i, tok]).item()
            gap_full = (best[i] - ref[i, tok]).item()
            if tie is not None and gap_half > tie and gap_full > tie:
                far.append(f"prompt {n} pos {i}: token {tok} is {gap_half:.3f} nats below "
                           f"transformers {dtype}'s max ({ref_half[i].argmax().item()}), "
                           f"{gap_full:.3f} below fp32's ({ref[i].argmax().item()})")
            for tid, lp in top.items():
                ours += (lp.logprob - ref[i, tid].item()) ** 2
                theirs += (ref_half[i, tid].item() - ref[i, tid].item()) ** 2
                norm += ref[i, tid].item() ** 2
    ours, theirs = (ours / norm) ** 0.5, (theirs / norm) ** 0.5
    what = f"{dtype}" + (f" with fp8 {fp8}" if fp8 else "")
    print(f"{label} logprob rel. error vs transformers fp32: raypp {ours:.2e}, "
          f"transformers {what} {theirs:.2e}; far greedy tokens: raypp {len(far)}, "
          f"transformers {what} {own_far}")
    print("\n".join(far))
    assert len(far) <= own_far, far
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


# -- decode graphs ---------------------------------------------------------------------------
def assert_graph_replays_match_eager(model: Any, graphs: Any, caches: list[torch.Tensor]) -> None:
    """Replays at 3, 1 and 8 rows (padding rows included, contexts from 1 to 120 tokens)
    give the eager unfused forward's logits on the same caches (relative error < 1e-4),
    and the padding rows write nothing. ``model`` is a whole model on one stage, ``caches``
    blocks of :data:`BLOCK_SIZE` tokens, eight blocks per row."""
    from raypp.step import ResolvedStep
    from raypp.worker.eager_metadata import attention_metadata

    for n, context in ((3, [5, 40, 17]), (1, [100]), (8, [1, 2, 3, 30, 31, 32, 33, 120])):
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(n)]
        step = ResolvedStep(
            step_id=0, input_ids=[7 + i for i in range(n)], positions=[c - 1 for c in context],
            query_start=list(range(n + 1)), seq_lens=context, seq_ids=list(range(n)),
            block_tables=tables,
            slot_mapping=[t[(c - 1) // BLOCK_SIZE] * BLOCK_SIZE + (c - 1) % BLOCK_SIZE
                          for t, c in zip(tables, context, strict=True)],
            sample_rows=list(range(n)), sampling=None)
        assert graphs.can_run(step)
        before = [c.clone() for c in caches]
        with torch.inference_mode():
            got = graphs.run(step, None).clone()
            after_graph = [c.clone() for c in caches]
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
            # the reference takes the unfused path: rotary, then store + decode kernels
            meta = replace(attention_metadata(step, torch.device(DEVICE)), decode_only=False)
            positions = torch.tensor(step.positions, device=DEVICE)
            ids = torch.tensor(step.input_ids, device=DEVICE)
            want = model.compute_logits(model(positions, meta, caches, input_ids=ids)[0])
        assert got.shape == want.shape == (n, want.shape[1])
        assert rel(got, want) < 1e-4, (n, rel(got, want))
        for c, g in zip(caches, after_graph, strict=True):  # padding rows wrote nothing
            torch.testing.assert_close(g.float(), c.float(), rtol=1e-4, atol=1e-4)  # FP8 too
