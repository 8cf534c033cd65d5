"""Batched, device-side sampling of the next token for each sampled row.

Randomness is counter-based: the noise for row r and vocabulary entry v is a
hash of ``(seed_r, output_index_r, v)``, so a seeded request draws the same
tokens whatever its batch-mates, its position in the batch, the pipeline layout,
or the device. Sampling uses the exponential race (``argmax p / E`` with
``E ~ Exp(1)``), which is exact sampling from ``p`` and needs no host round-trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raypp.step import RowLogprobs, SamplingBatch
from raypp.worker.logits_processors import shape_logits

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


@dataclass
class SamplingTensors:
    """A :class:`SamplingBatch` on the device, built once per step (one host copy)."""

    temperature: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor  # [rows] int64
    output_index: torch.Tensor  # [rows] int64
    all_greedy: bool  # known on the host, so no device sync decides the path
    num_logprobs: list[int]  # -1: none

    @classmethod
    def build(cls, batch: SamplingBatch, device: torch.device) -> SamplingTensors:
        floats = torch.tensor([batch.temperature, batch.top_p, batch.min_p], dtype=torch.float32)
        ints = torch.tensor([batch.top_k, batch.seeds, batch.output_index], dtype=torch.int64)
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        return cls(floats[0], ints[0], floats[1], floats[2], ints[1], ints[2],
                   all(t == 0 for t in batch.temperature), batch.num_logprobs)

    @property
    def wants_logprobs(self) -> bool:
        return any(n >= 0 for n in self.num_logprobs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (first index of the maximum), faster on a GPU.

    A row's argmax over a large vocabulary runs as one thread block; split into
    chunks it spreads over the device (first maximal chunk, then its first
    maximal entry: the same index).
    """
    rows, vocab = logits.shape
    chunk = next((c for c in (512, 256, 128) if vocab % c == 0), 0)
    if not logits.is_cuda or not chunk:
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // chunk, chunk)
    inner = chunks.argmax(dim=-1)  # [rows, chunks]
    best = chunks.gather(2, inner[:, :, None])[:, :, 0].argmax(dim=-1)  # [rows]
    return best * chunk + inner.gather(1, best[:, None])[:, 0]


def sample_tokens(logits: torch.Tensor, t: SamplingTensors, offset: int = 0) -> torch.Tensor:
    """``[rows]`` int64 sampled ids, on the device (no host sync).

    ``logits`` may be in the model's dtype: greedy rows take its argmax (an
    upcast changes no order), random rows are sampled in float32. ``offset``
    advances each row's RNG counter: the ``offset``-th token after the one
    ``t.output_index`` names (multi-step decode).
    """
    tokens = argmax(logits)
    if t.all_greedy:
        return tokens
    greedy = t.temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, t.temperature)[:, None]
    probs = _filter(scaled, t.top_k, t.top_p, t.min_p).softmax(dim=-1)
    noise = uniform_noise(t.seeds, t.output_index + offset, logits.shape[1])
    race = probs / (-torch.log(noise))
    return torch.where(greedy, tokens, argmax(race))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[RowLogprobs | None]]:
    """Sampled token per row, and logprobs where asked: of the model's distribution after
    the row's logit bias and grammar mask (:mod:`raypp.worker.logits_processors`), before
    penalties, temperature and the top-k / top-p / min-p filters."""
    t = SamplingTensors.build(batch, logits.device)
    logits = shape_logits(logits, batch)
    stats = logprob_stats(logits, t)
    if batch.any_penalties:
        logits = apply_penalties(logits.to(torch.float32, copy=True), batch)
    tokens = sample_tokens(logits, t)
    if stats is None:
        return tokens.tolist(), [None] * len(batch.temperature)
    return tokens.tolist(), row_logprobs(*sampled_logprobs(stats, tokens), t.num_logprobs)


LogprobStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def logprob_stats(logits: torch.Tensor, t: SamplingTensors) -> LogprobStats | None:
    """``(log_softmax, top values, top ids)`` on the device, or ``None`` if no row asks."""
    if not t.wants_logprobs:
        return None
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_vals, top_ids = logprobs.topk(max(max(t.num_logprobs), 1), dim=-1)
    return logprobs, top_vals, top_ids


def sampled_logprobs(stats: LogprobStats, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Device tensors ``(top values, top ids, sampled logprob, sampled rank)``: what
    :func:`row_logprobs` needs of one step."""
    logprobs, top_vals, top_ids = stats
    sampled = logprobs.gather(1, tokens[:, None])[:, 0]
    ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
    return top_vals, top_ids, sampled, ranks


def row_logprobs(top_vals: torch.Tensor, top_ids: torch.Tensor, sampled: torch.Tensor,
                 ranks: torch.Tensor, num_logprobs: list[int]) -> list[RowLogprobs | None]:
    """Per row: :class:`RowLogprobs` with its top ``n`` (``None`` where ``n < 0``)."""
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    sampled, ranks = sampled.tolist(), ranks.tolist()
    out: list[RowLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n < 0:
            out.append(None)
            continue
        out.append(RowLogprobs(top_ids[row][:n], top_vals[row][:n], sampled[row], ranks[row]))
    return out
