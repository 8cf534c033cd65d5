"""Which requests a pipeline failure may have been caused by, and which one it was.

Plain Python, no engine, no torch: :mod:`raypp.engine.recovery` applies it. A request
with a sequence in flight when the pipeline fails (a stage died or was stuck) gets a
*strike* and becomes a *suspect*. Suspects are held out of the scheduler and released
one at a time after the workers are replaced (:meth:`Quarantine.release`); a released
suspect is *on trial* until it produces a token (or finishes), and is then cleared.
So at most one suspect is ever in flight: a failure while it runs is its next strike,
and the requests beside it, not suspects, get only their first. A request that reaches
``limit`` strikes in a row (no token produced between them) is returned by
:meth:`Quarantine.on_failure` to be failed as the likely cause: a poison input fails
after ``limit`` failures, and other requests are not blamed for it.

The price: a failure while a suspect is on trial is blamed on it even when unrelated
(two independent stage deaths within one recomputation), and suspects recompute one
pipeline pass each, in arrival order, before the last of them streams again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from raypp.engine.sequence import Request


@dataclass
class _Trial:
    request: Request
    tokens: int  # output tokens of its sequences when it was released


def output_tokens(request: Request) -> int:
    return sum(len(seq.output_token_ids) for seq in request.seqs)


class Quarantine:
    """Strikes per request, the suspects held back, and the one on trial."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        self.limit = limit
        self.strikes: dict[str, int] = {}  # request id -> failures in a row it was at
        self._held: deque[Request] = deque()
        self._trial: _Trial | None = None

    def is_suspect(self, request_id: str) -> bool:
        return request_id in self.strikes

    @property
    def num_held(self) -> int:
        return len(self._held)

    def on_failure(self, in_flight: list[Request]) -> list[Request]:
        """Count a strike against each request in ``in_flight`` (each once); returns
        those that reached ``limit``, which the caller fails (they are forgotten here).
        Every other suspect is held, the one on trial back at the front."""
        poisoned, ids = [], set()
        for request in in_flight:
            if request.request_id in ids:
                continue
            ids.add(request.request_id)
            strikes = self.strikes.get(request.request_id, 0) + 1
            if strikes >= self.limit:
                self.strikes.pop(request.request_id, None)
                poisoned.append(request)
            else:
                self.strikes[request.request_id] = strikes
        trial, self._trial = self._trial, None
        held = {r.request_id for r in self._held}
        if trial is not None and trial.request.request_id in self.strikes:
            self._held.appendleft(trial.request)
            held.add(trial.request.request_id)
        for request in in_flight:  # new suspects, in the order they were in flight
            if request.request_id in self.strikes and request.request_id not in held:
                self._held.append(request)
                held.add(request.request_id)
        return poisoned

    def release(self, live: dict[str, Request]) -> Request | None:
        """The next suspect to put back in the scheduler, or ``None`` while one is on
        trial or none is held. ``live`` is the engine's request table: a suspect no
        longer in it (aborted) is dropped, and the one on trial is cleared once it
        produced a token or finished."""
        trial = self._trial
        if trial is not None:
            request = trial.request
            if (live.get(request.request_id) is request and not request.finished
                    and output_tokens(request) == trial.tokens):
                return None
            self.strikes.pop(request.request_id, None)
            self._trial = None
        while self._held:
            request = self._held.popleft()
            if live.get(request.request_id) is request and not request.finished:
                self._trial = _Trial(request, output_tokens(request))
                return request
            self.strikes.pop(request.request_id, None)
        return None

    def forget(self, request_id: str) -> None:
        """Drop a request (finished with an error, or the engine stopped)."""
        self.strikes.pop(request_id, None)
