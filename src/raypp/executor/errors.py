"""How a step can fail, told apart so the engine reacts to each correctly.

- :class:`StageError`: an exception inside one stage's compute. Only that step's
  requests fail; the executor stays usable.
- :class:`StageDiedError`: a stage actor (or its node, or a channel) is gone. The
  executor can run no more steps: the engine replaces it.
- :class:`StepTimeoutError`: no result within ``RAYPP_STEP_TIMEOUT_S``. Treated
  like a death: the engine replaces the executor.
- :class:`EngineDeadError`: the engine stopped (restarts exhausted or shut down).
"""

from __future__ import annotations


class StageError(RuntimeError):
    """An exception raised inside a stage; the message names the stage and step."""


class StageDiedError(RuntimeError):
    """A stage actor died or its transport broke; this executor is unusable."""


class StepTimeoutError(TimeoutError):
    """A step gave no result in time although no stage is known dead."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve: it was shut down or exceeded its restart budget."""


class RequestFailedError(RuntimeError):
    """Raised by ``LLM.generate`` when requests failed.

    ``errors`` maps prompt index → error text; ``outputs`` holds every request's
    output in prompt order (failed ones finished with ``finish_reason="error"``,
    or ``None`` for requests cut short when the pipeline went down).
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
