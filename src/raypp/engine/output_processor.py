"""Sampled tokens in, :class:`~raypp.outputs.RequestOutput` s out: every stop rule in one
place, incremental detokenization, logprobs.

Stops, in the order they apply to each sampled token: a stop or EOS id (once
``min_tokens`` are out), a stop string in the decoded text (which outranks the
length limit on the same token), then the length limit (``max_tokens`` or
``max_model_len``). A constrained sequence also stops once its grammar is complete
(:mod:`raypp.engine.structured`: every appended token advances its matcher). Tokens a
multi-step decode round sampled past a stop are dropped.
"""

from __future__ import annotations

import time
from typing import Any

from raypp.engine import detokenizer, structured
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Request, Sequence, SequenceStatus
from raypp.engine.speculative import speculative_metrics
from raypp.outputs import CompletionOutput, Logprob, RequestOutput
from raypp.step import RowLogprobs, StepOutput


class OutputProcessor:
    """Applies step results to sequences and builds request outputs.

    ``requests`` is the engine's live request table: a request is removed from it
    once its final output was built. ``emit_unfinished``: also return updates of
    requests still running (streaming); off, only finished requests are returned.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], scheduler: Scheduler,
                 requests: dict[str, Request]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.requests = requests
        self.emit_unfinished = True
        self.tokens_generated = 0

    def append_results(self, batch: MicroBatch, result: StepOutput
                       ) -> tuple[list[Sequence], list[Sequence]]:
        """Append each sequence's sampled tokens in order, up to its first stop.

        Everything the next micro-batch depends on happens here: tokens appended,
        stops by id, length or stop string applied, finished sequences' blocks
        released. Sequences with stop strings are detokenized after every token; the
        others' text is left to :meth:`finish_text` (returned second), which the engine
        runs while the next micro-batch is on the device. Returns ``(sequences, text
        pending)``.
        """
        self.scheduler.complete(batch, sampled=result.token_ids)
        sampled = [item.seq for item in batch.seqs if item.sample]
        assert len(sampled) == len(result.token_ids), (len(sampled), len(result.token_ids))
        logprobs = result.logprobs or [None] * len(sampled)
        rows = [(seq, tokens, row_logprobs)
                for seq, tokens, row_logprobs in zip(sampled, result.token_ids, logprobs)
                if seq.status is SequenceStatus.RUNNING]  # others were aborted in flight
        by_tokens = [row for row in rows if not row[0].params.stop_strings]
        for seq, tokens, row_logprobs in by_tokens:
            self._append_tokens(seq, tokens, row_logprobs)
        by_text = [row for row in rows if row[0].params.stop_strings]
        for j in range(max((len(row[1]) for row in by_text), default=0)):
            live = [row for row in by_text
                    if row[0].status is SequenceStatus.RUNNING and j < len(row[1])]
            for seq, tokens, row_logprobs in live:
                self._append_tokens(seq, tokens[j:j + 1],
                                    row_logprobs[j:j + 1] if row_logprobs else None,
                                    length_stops=False)  # a stop string outranks the length
            self._detokenize([row[0] for row in live])
        seqs = [row[0] for row in rows]
        for seq in seqs:
            if seq.finished:
                self.scheduler.finish(seq)
        return seqs, [row[0] for row in by_tokens]

    def finish_text(self, seqs: list[Sequence], text_pending: list[Sequence]
                    ) -> list[RequestOutput]:
        """Detokenize ``text_pending``; the outputs of the requests ``seqs`` belong to."""
        self._detokenize(text_pending)
        return self._outputs_of(seqs)

    # -- stops ---------------------------------------------------------------------------
    def _append_tokens(self, seq: Sequence, tokens: list[int],
                       row_logprobs: list[RowLogprobs] | None, length_stops: bool = True) -> None:
        """Append sampled tokens up to the first that stops ``seq`` by id or by length.

        Stop and EOS ids count once ``min_tokens`` are out; the token that reaches
        ``max_tokens`` or ``max_model_len`` ends the sequence unless
        ``length_stops`` is off (the caller then checks stop strings first).
        """
        params, out = seq.params, seq.output_token_ids
        before = len(out)
        take = len(tokens)
        if length_stops:
            take = min(take, self.scheduler.room(seq))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        stopped_by = None
        if stop_ids:
            for j in range(max(0, params.min_tokens - before - 1), take):
                if tokens[j] in stop_ids:
                    take, stopped_by = j + 1, tokens[j]
                    break
        out.extend(tokens[:take])
        self.tokens_generated += take
        if seq.logprobs is not None and row_logprobs is not None:
            seq.logprobs.extend(self._logprob_dict(t, lp)
                                for t, lp in zip(tokens[:take], row_logprobs))
        if stopped_by is not None:
            seq.finish("stop", stopped_by if stopped_by in params.stop_token_ids else None)
        elif seq.grammar is not None and structured.advance(seq, tokens[:take]):
            seq.finish("stop")  # its grammar is complete
        elif length_stops and self.scheduler.room(seq) == 0:
            seq.finish("length")

    def _detokenize(self, seqs: list[Sequence]) -> None:
        """Extend the sequences' text; apply stop strings (then the length limit to those
        sequences); release the held-back text of finished sequences."""
        if not seqs:
            return
        detokenizer.append_text(self.tokenizer, seqs)
        for seq in seqs:
            if not seq.finished and seq.params.stop_strings:
                self._stop_by_text(seq)
            if seq.finished and not isinstance(seq.stop_reason, str):  # not cut at a stop string
                detokenizer.flush(self.tokenizer, seq)

    def _stop_by_text(self, seq: Sequence) -> None:
        """Stop strings (once ``min_tokens`` are out), then the length limit."""
        if len(seq.output_token_ids) >= seq.params.min_tokens and _truncate_at_stop_string(seq):
            return
        if self.scheduler.room(seq) <= 0:
            seq.finish("length")

    # -- outputs -------------------------------------------------------------------------
    def _outputs_of(self, seqs: list[Sequence]) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for seq in seqs:
            request = self.requests.get(seq.request_id)
            if request is not None:
                if request.first_token_time is None:
                    request.first_token_time = now
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished or self.emit_unfinished:
                outputs.append(request_output(request))
            if finished:
                del self.requests[request.request_id]
        return outputs

    def _logprob_dict(self, token: int, row: RowLogprobs) -> dict[int, Logprob]:
        out = {
            tid: Logprob(lp, rank + 1, self.tokenizer.decode([tid]))
            for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs))
        }
        if token not in out:
            out[token] = Logprob(row.sampled_logprob, row.sampled_rank, self.tokenizer.decode([token]))
        return out


def _truncate_at_stop_string(seq: Sequence) -> bool:
    for stop in seq.params.stop_strings:
        at = seq.text.find(stop)
        if at >= 0:
            end = at + len(stop) if seq.params.include_stop_str_in_output else at
            seq.text = seq.text[:end]
            seq.finish("stop", stop)
            return True
    return False


def request_output(request: Request) -> RequestOutput:
    """A snapshot of ``request`` for callers (copies; later steps do not change it)."""
    completions = [
        CompletionOutput(
            index=seq.index,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        )
        for seq in request.seqs
    ]
    metrics = {"arrival_time": request.arrival_time}
    if request.first_token_time is not None:
        metrics["first_token_time"] = request.first_token_time
    drafts = [s.draft_stats for s in request.seqs if s.draft_stats is not None]
    if drafts:
        metrics.update(speculative_metrics(sum(d.verifications for d in drafts),
                                           sum(d.drafted for d in drafts),
                                           sum(d.accepted for d in drafts)))
    return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                         completions, request.finished, metrics, request.error,
                         request.error_kind, request.seqs[0].num_cached_tokens or 0)
