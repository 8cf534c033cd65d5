"""Batched, device-side sampling of the next token for each sampled row.

Randomness is counter-based: the noise for row r and vocabulary entry v is a
hash of ``(seed_r, output_index_r, v)``, so a seeded request draws the same
tokens whatever its batch-mates, its position in the batch, the pipeline layout,
or the device. Sampling uses the exponential race (``argmax p / E`` with
``E ~ Exp(1)``), which is exact sampling from ``p`` and needs no host round-trip.
"""

from __future__ import annotations

import torch

from raypp.engine.step import RowLogprobs, SamplingBatch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27, so products with 32-bit values stay inside int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` floats in (0, 1), a pure function of (seed, counter, column)."""
    row_key = _hash32(_hash32(seeds & _MASK32) ^ _hash32((counters + 0x9E37) & _MASK32))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32(row_key[:, None] ^ _hash32(cols)[None, :])
    return ((bits >> 8).float() + 0.5) / float(1 << 24)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties."""
    vocab = logits.shape[1]
    device = logits.device
    for row in range(logits.shape[0]):
        rep = batch.repetition_penalty[row]
        if rep != 1:
            seen = torch.tensor(batch.prompt_tokens[row] + batch.output_tokens[row],
                                dtype=torch.int64, device=device).unique()
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / rep, vals * rep)
        pres, freq = batch.presence_penalty[row], batch.frequency_penalty[row]
        if (pres != 0 or freq != 0) and batch.output_tokens[row]:
            out = torch.tensor(batch.output_tokens[row], dtype=torch.int64, device=device)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[row] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus, or under min-p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    # nucleus: drop a token once the mass strictly before it already reaches top_p
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[RowLogprobs | None]]:
    """Sampled token per row, and logprobs (of the raw model distribution) where asked."""
    # logits: [rows, vocab] float32
    device = logits.device
    raw_logprobs = _logprobs_if_needed(logits, batch)
    if batch.any_penalties:
        logits = apply_penalties(logits.clone(), batch)
    temperature = torch.tensor(batch.temperature, dtype=torch.float32, device=device)
    greedy = temperature == 0
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
        scaled = _filter(
            scaled,
            torch.tensor(batch.top_k, dtype=torch.int64, device=device),
            torch.tensor(batch.top_p, dtype=torch.float32, device=device),
            torch.tensor(batch.min_p, dtype=torch.float32, device=device),
        )
        probs = scaled.softmax(dim=-1)
        noise = uniform_noise(
            torch.tensor(batch.seeds, dtype=torch.int64, device=device),
            torch.tensor(batch.output_index, dtype=torch.int64, device=device),
            logits.shape[1],
        )
        race = probs / (-torch.log(noise))
        tokens = torch.where(greedy, tokens, race.argmax(dim=-1))
    token_list = tokens.tolist()
    return token_list, _gather_logprobs(raw_logprobs, token_list, batch)


def _logprobs_if_needed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    if all(n < 0 for n in batch.num_logprobs):
        return None
    return torch.log_softmax(logits, dim=-1)


def _gather_logprobs(logprobs: torch.Tensor | None, tokens: list[int],
                     batch: SamplingBatch) -> list[RowLogprobs | None]:
    if logprobs is None:
        return [None] * len(tokens)
    out: list[RowLogprobs | None] = []
    max_n = max(batch.num_logprobs)
    top_vals, top_ids = logprobs.topk(max(max_n, 1), dim=-1)
    sampled = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    sampled, ranks = sampled.tolist(), ranks.tolist()
    for row, n in enumerate(batch.num_logprobs):
        if n < 0:
            out.append(None)
            continue
        out.append(RowLogprobs(top_ids[row][:n], top_vals[row][:n], sampled[row], ranks[row]))
    return out
