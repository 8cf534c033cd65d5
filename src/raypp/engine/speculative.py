"""Speculative decoding on the driver: drafting tokens for the target to verify, and
each sequence's draft length.

A decode row with a draft feeds its last token and the ``d`` drafted ones in one step
(positions ``p .. p + d``); the last stage samples the target at all ``d + 1`` of them,
with the counter-based noise each output index has anyway, and accepts the drafted
tokens while they equal the target's samples; the first sample that differs (or the
one after the last draft) is the step's extra token (:mod:`raypp.worker.verifier`). A
drafted token is thus accepted exactly when the target would have sampled it, so
outputs are token for token those of decoding without speculation, greedy and
seeded sampling alike (the standard rejection rule for a deterministic draft: accept
``x`` with probability ``p(x)``, else sample the rest of ``p``). Rejected drafts' KV
stays in slots that the sequence's next positions overwrite: the driver counts only
the accepted positions as computed, so nothing rolls back but that count.

Which rows draft, and how many tokens, is decided here for the round policy
(:mod:`raypp.engine.rounds`): rows with penalties, a grammar or a logit bias never
draft (a later position's penalties or token mask would depend on unaccepted tokens);
a sequence's cap grows by one after a draft accepted whole and falls to one more than
the accepted count otherwise; after ``MISSES_BEFORE_PAUSE`` verifications in a row
that accept nothing, it drafts nothing for ``PAUSE_SCHEDULINGS`` schedulings, then
tries again. A row is *quiet* once ``QUIET_AFTER`` schedulings in a row drafted nothing
for it (no n-gram recurred, or paused): a round of only quiet rows may be continued
ahead like one without speculation, for at most ``QUIET_CHAIN_ROUNDS`` rounds of at most
``QUIET_ROUND_STEPS`` steps, after which its rows look for drafts again
(:meth:`raypp.engine.rounds.RoundPolicy.may_continue`). So rows speculation does not help
run at nearly plain decoding's pace, not one synchronous step at a time.

Proposers: :class:`NgramProposer` (prompt lookup) runs here. A draft model
(:class:`~raypp.engine.draft_proposer.DraftModelProposer`) runs on the first stage's
worker, at the start of the step that verifies its draft (its own KV blocks beside the
target's, indexed by the same block tables; :mod:`raypp.engine.draft_proposer` and
:mod:`raypp.worker.draft_runner`): here it drafts placeholders, which that stage fills.
Heads that draft from the target's hidden states (EAGLE, MTP) would run on the last
stage, after sampling, and return their draft with the step's tokens for the next step
to verify. All fit the same step shape: rows ending in drafted tokens,
``StepInput.draft_lens``.
"""

from __future__ import annotations

import numpy as np

from raypp.engine.draft_proposer import DraftModelProposer
from raypp.engine.sequence import DraftStats, Sequence
from raypp.speculative_config import SpeculativeConfig

MISSES_BEFORE_PAUSE = 3
PAUSE_SCHEDULINGS = 8
QUIET_AFTER = 2
QUIET_CHAIN_ROUNDS = 4
QUIET_ROUND_STEPS = 8  # so at most 32 tokens pass between a quiet row's lookups


def speculative_metrics(verifications: int, drafted: int, accepted: int) -> dict[str, float]:
    """The counters, the acceptance rate (accepted / drafted tokens) and the mean accepted
    length (tokens a verification step emits: its accepted drafts and one more, the
    definition vLLM reports), under the names ``RequestOutput.metrics`` and the
    benchmarks use."""
    return {"spec_verifications": verifications, "spec_drafted_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_mean_accepted_length": round(1 + accepted / verifications, 4)
            if verifications else 0.0}


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for ``n`` from ``max_n`` down to ``min_n``."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``seq``'s prompt and output (``seq.draft_stats``
        set: it keeps the sequence's token array between lookups)."""
        stats = seq.draft_stats
        assert stats is not None, "Speculator.draft sets a sequence's draft stats first"
        if stats.history is None:
            stats.history = TokenHistory()
        return self.propose(stats.history.of(seq), k)

    def propose(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (empty if no n-gram recurs)."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # ends: the earlier positions j (arr[j + 1] exists) where the last n tokens end
        # too, for n = 1, 2, ...; a match of n + 1 tokens is one of n, so the candidates
        # only shrink: one pass over the history, then only over them
        ends = np.flatnonzero(arr[:length - 1] == arr[length - 1])
        longest = None
        for n in range(1, min(self.max_n, length - 1) + 1):
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[arr[ends - (n - 1)] == arr[length - n]]
            if not ends.size:
                break
            if n >= self.min_n:
                longest = ends
        if longest is None:
            return []
        start = int(longest[-1]) + 1  # after the latest occurrence
        return arr[start:start + k].tolist()


class TokenHistory:
    """A sequence's prompt and output as one int64 array, extended by the tokens accepted
    since the last lookup: a lookup costs the new tokens' copy, not the whole history's
    (a sequence's tokens only ever grow; a shorter sequence rebuilds it)."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.int64)
        self._length = 0

    def of(self, seq: Sequence) -> np.ndarray:
        """``seq.all_token_ids`` as an array (a view, valid until the next call)."""
        total = seq.num_tokens
        if total < self._length:
            self._length = 0
        if total > len(self._buffer):
            grown = np.empty(max(total, 2 * len(self._buffer), 256), dtype=np.int64)
            grown[:self._length] = self._buffer[:self._length]
            self._buffer = grown
        if total > self._length:
            self._buffer[self._length:total] = seq.token_ids(self._length, total)
            self._length = total
        return self._buffer[:total]


class Speculator:
    """Drafts for one engine's sequences and adapts their draft lengths."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.adaptive = config.adaptive
        # the first stage's draft model, or prompt lookup here
        self.draft_model = DraftModelProposer() if config.method == "draft_model" else None
        self.proposer: DraftModelProposer | NgramProposer = (
            self.draft_model or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
        self.verifications = 0  # rows verified with a draft, since start-up
        self.drafted = 0  # tokens drafted and verified
        self.accepted = 0  # of which accepted

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Tokens to verify after ``seq``'s last one, at most ``limit`` (what its length
        limits and the step's token budget leave)."""
        if seq.params.uses_penalties or seq.params.shapes_logits:
            return []  # a later position's penalties or mask would depend on the draft
        stats = seq.draft_stats
        if stats is None:
            stats = seq.draft_stats = DraftStats(cap=self.k)
        if stats.pause > 0:
            stats.pause -= 1
            draft = []
        else:
            n = min(stats.cap, limit)
            draft = self.proposer.draft(seq, n) if n > 0 else []
        stats.quiet = 0 if draft else stats.quiet + 1
        return draft

    @staticmethod
    def quiet(seqs: list[Sequence]) -> bool:
        """True if every one of ``seqs`` is quiet: ``QUIET_AFTER`` schedulings in a row
        drafted nothing for it."""
        return all(s.draft_stats is not None and s.draft_stats.quiet >= QUIET_AFTER
                   for s in seqs)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification of ``seq`` accepted ``accepted`` of its ``drafted`` tokens."""
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        stats = seq.draft_stats
        assert stats is not None
        stats.drafted += drafted
        stats.accepted += accepted
        stats.verifications += 1
        if not self.adaptive:
            return
        stats.cap = min(self.k, stats.cap + 1) if accepted == drafted else accepted + 1
        stats.misses = stats.misses + 1 if accepted == 0 else 0
        if stats.misses >= MISSES_BEFORE_PAUSE:
            stats.misses, stats.pause = 0, PAUSE_SCHEDULINGS
