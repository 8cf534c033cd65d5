"""Request and sequence state, owned by the engine's driver process."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from raypp.errors import ErrorKind
from raypp.outputs import Logprob
from raypp.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DraftStats:
    """One sequence's speculative decoding: its draft-length cap now, the adaptation's
    state, and what it drafted and had accepted (:mod:`raypp.engine.speculative`)."""

    cap: int  # the most tokens drafted for it next
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # schedulings left without drafting
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0  # steps that verified a draft of it
    quiet: int = 0  # schedulings in a row that drafted nothing for it (no match, paused)
    # the n-gram proposer's copy of prompt + output, grown as tokens are accepted
    # (:class:`raypp.engine.speculative.TokenHistory`)
    history: Any = None


@dataclass
class Sequence:
    """One completion being generated.

    Invariant: the KV of ``all_token_ids[:num_computed_tokens]`` is in the cache
    blocks listed by ``block_table``. ``num_inflight_tokens`` more positions are fed to
    micro-batches in flight (their KV is being written; a decode round of K steps
    feeds K: its input token and the K - 1 it samples and feeds back), so the next
    micro-batch feeds from position ``num_computed_tokens + num_inflight_tokens``.
    Prefix caching: ``block_hashes`` are the content hashes of the full blocks hashed
    so far (:mod:`raypp.engine.block_hash`); the first ``num_registered_blocks`` of
    ``block_table`` were offered to the cache (computed, full);
    ``num_cached_tokens`` is how many prompt tokens the cache supplied when the
    sequence was first scheduled (``None`` before). ``block_table`` only grows, by
    appending, until the blocks are freed; ``block_epoch`` counts those frees, so a
    table of another epoch is another table (what the stages hold is tracked by
    :class:`~raypp.engine.step_builder.StepBuilder`).

    With a draft model (:mod:`raypp.engine.draft_proposer`), ``num_draft_computed`` is
    how many leading tokens' KV the draft's cache holds in the same blocks (at most
    ``num_computed_tokens`` once nothing is in flight; ``None`` without a draft model);
    only blocks both caches hold are offered to the prefix cache.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_epoch: int = 0  # bumped each time the blocks are freed (BlockManager.free)
    num_computed_tokens: int = 0
    num_draft_computed: int | None = None  # with a draft model (docstring)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_inflight_tokens: int = 0  # positions fed to micro-batches in flight (docstring)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0
    # structured outputs: the matcher of its grammar (raypp.engine.structured.SeqGrammar),
    # which has accepted exactly output_token_ids
    grammar: Any = None
    draft_stats: DraftStats | None = None  # with speculative decoding on, once drafted for
    # incremental detokenization
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):end - len(prompt)]
        return prompt[start:] + self.output_token_ids[:end - len(prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_flight(self) -> bool:
        """True while a micro-batch in flight feeds this sequence."""
        return self.num_inflight_tokens > 0

    @property
    def next_position(self) -> int:
        """The position the next micro-batch of this sequence feeds first."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens this sequence samples in flight, not yet appended: the micro-batches in
        flight feed up to ``next_position``; each fed position from its last token on
        samples one."""
        return max(0, self.next_position + 1 - self.num_tokens)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class Request:
    """A user request: one prompt, ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
