"""How a step or a request can fail, told apart so callers react to each correctly.

- :class:`StageError`: an exception inside one stage's compute. Only that step's
  requests fail; the executor stays usable.
- :class:`StageDiedError`: a stage actor (or its node, or a channel) is gone. The
  executor can run no more steps: the engine replaces it.
- :class:`StepTimeoutError`: no stage made progress for the step timeout (a long
  step that advances is not one). Treated like a death: the engine replaces the
  executor. After either, the engine re-queues the requests it had running
  (:mod:`raypp.engine.recovery`).
- :class:`EngineDeadError`: the engine stopped (restarts exhausted or shut down).

A request that fails carries an :class:`ErrorKind` on its ``RequestOutput``, so
callers branch on the kind, never on the text of the message.
"""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    """Why a request finished with an error (``RequestOutput.error_kind``)."""

    STAGE_ERROR = "stage_error"  # its micro-batch raised inside a stage; others unaffected
    # a stage died / stopped advancing with it in flight, and max_failures_per_request=1
    # (by default such requests are re-queued instead); the workers are replaced
    STAGE_DIED = "stage_died"
    STEP_TIMEOUT = "step_timeout"
    ENGINE_DEAD = "engine_dead"  # the engine stopped (restart budget spent or shut down)
    INVALID_REQUEST = "invalid_request"  # refused after it was queued (its grammar did not compile)
    # in flight at max_failures_per_request pipeline failures in a row with no token between
    # them: likely their cause (a poison input), so not re-queued again
    POISON_REQUEST = "poison_request"

    @property
    def retryable(self) -> bool:
        """True when the engine recovers on its own and a retry may succeed."""
        return self in (ErrorKind.STAGE_DIED, ErrorKind.STEP_TIMEOUT)


class StageError(RuntimeError):
    """An exception raised inside a stage; the message names the stage and step."""


class StageDiedError(RuntimeError):
    """A stage actor died or its transport broke; this executor is unusable."""


class StepTimeoutError(TimeoutError):
    """A step gave no result in time although no stage is known dead."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve: it was shut down or exceeded its restart budget."""


class ContextLengthError(ValueError):
    """A request that does not fit the context: its prompt, or its prompt plus
    ``max_tokens``, exceeds ``max_model_len``; ``field`` names what to change
    (``"prompt"`` or ``"max_tokens"``). Raised before the request is queued."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class RequestFailedError(RuntimeError):
    """Raised by ``LLM.generate`` when requests failed.

    ``errors`` maps prompt index → error text; ``outputs`` holds every request's
    output in prompt order (failed ones finished with ``finish_reason="error"``
    and an ``error_kind``, or ``None`` for requests cut short when the pipeline
    went down).
    """

    def __init__(self, errors: dict[int, str], outputs: list):
        self.errors = errors
        self.outputs = outputs
        first = next(iter(errors.items()))
        super().__init__(f"{len(errors)} request(s) failed; prompt {first[0]}: {first[1]}")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
