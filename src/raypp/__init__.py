"""raypp: pipeline-parallel LLM inference on Ray Compiled Graphs.

Public surface: :class:`LLM`, :class:`SamplingParams` (with
:class:`StructuredOutputsParams`), :class:`RequestOutput`, :class:`CompletionOutput`.
"""

from raypp import logger as _logger
from raypp.errors import (
    EngineDeadError,
    ErrorKind,
    RequestFailedError,
    StageDiedError,
    StageError,
    StepTimeoutError,
)
from raypp.outputs import CompletionOutput, Logprob, RequestOutput
from raypp.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
    "EngineDeadError", "ErrorKind", "RequestFailedError", "StageDiedError", "StageError", "StepTimeoutError",
]
__version__ = "0.1.0"

_logger.configure()


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in Ray and torch
        from raypp.llm import LLM

        return LLM
    raise AttributeError(f"module 'raypp' has no attribute {name!r}")
