"""The last stage's half of speculative decoding: sampling the target at drafted
positions and accepting the draft while it agrees.

Sampled row ``r`` of a ``VERIFY`` step ends in ``d = draft_lens[r]`` drafted tokens;
its last ``d + 1`` positions are verified: position ``j`` (``0 .. d``) is sampled as
the ``output_index + j``-th token, with the same counter-based noise an unspeculated
run uses for that token (:mod:`raypp.worker.sampler`). Draft ``j`` is accepted while
every sample before it was and sample ``j`` equals it; the row returns its ``a``
accepted drafts and sample ``a``: exactly the tokens decoding one at a time samples
(the accepted drafts equal the samples at their positions).
"""

from __future__ import annotations

import torch

from raypp.step import ResolvedStep, RowLogprobs, SamplingBatch
from raypp.worker.sampler import sample


def verified_rows(step: ResolvedStep) -> list[int]:
    """Flat token indices whose logits a ``VERIFY`` step samples: per sampled row, its
    drafted positions and the one before them, in order."""
    out: list[int] = []
    for last, d in zip(step.sample_rows, step.draft_lens, strict=True):
        out.extend(range(last - d, last + 1))
    return out


def drafts_of(step: ResolvedStep) -> list[list[int]]:
    """Per sampled row, the drafted tokens it ends with."""
    ids = step.input_ids
    return [ids[last - d + 1:last + 1] for last, d in zip(step.sample_rows, step.draft_lens,
                                                          strict=True)]


def accepted_count(samples: list[int], draft: list[int]) -> int:
    """How many of ``draft`` are accepted: the length of the prefix on which the target's
    samples equal it."""
    for j, token in enumerate(draft):
        if samples[j] != token:
            return j
    return len(draft)


def expand(batch: SamplingBatch, draft_lens: list[int]) -> SamplingBatch:
    """``batch`` with row ``r`` repeated ``draft_lens[r] + 1`` times, the ``j``-th copy
    sampling output index ``output_index[r] + j``."""
    def rep(values: list) -> list:
        return [v for v, d in zip(values, draft_lens, strict=True) for _ in range(d + 1)]

    return SamplingBatch(
        temperature=rep(batch.temperature), top_p=rep(batch.top_p), top_k=rep(batch.top_k),
        min_p=rep(batch.min_p), seeds=rep(batch.seeds),
        output_index=[i + j for i, d in zip(batch.output_index, draft_lens, strict=True)
                      for j in range(d + 1)],
        num_logprobs=rep(batch.num_logprobs), presence_penalty=rep(batch.presence_penalty),
        frequency_penalty=rep(batch.frequency_penalty),
        repetition_penalty=rep(batch.repetition_penalty),
        prompt_tokens=rep(batch.prompt_tokens) if batch.prompt_tokens else [],
        output_tokens=rep(batch.output_tokens) if batch.output_tokens else [],
        token_bitmask=rep(batch.token_bitmask) if batch.token_bitmask else [],
        logit_bias=rep(batch.logit_bias) if batch.logit_bias else [])


def verify(logits: torch.Tensor, step: ResolvedStep
           ) -> tuple[list[list[int]], list[list[RowLogprobs] | None]]:
    """Per sampled row of ``step``: its accepted drafted tokens and one more, and their
    logprobs where asked. ``logits``: ``[len(verified_rows(step)), vocab]``."""
    assert step.sampling is not None
    tokens, logprobs = sample(logits, expand(step.sampling, step.draft_lens))
    out_tokens: list[list[int]] = []
    out_logprobs: list[list[RowLogprobs] | None] = []
    i = 0
    for draft in drafts_of(step):
        samples = tokens[i:i + len(draft) + 1]
        accepted = accepted_count(samples, draft)
        keep = accepted + 1
        out_tokens.append(draft[:accepted] + [samples[accepted]])
        row = logprobs[i:i + keep]
        out_logprobs.append(None if row[0] is None else list(row))  # type: ignore[arg-type]
        i += len(draft) + 1
    return out_tokens, out_logprobs
