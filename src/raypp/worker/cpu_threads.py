"""How many torch threads a CPU stage computes a step with.

A stage worker gets the host's cores divided by the workers (or ``cpu_threads``).
A step of a few rows (small-batch decode) is bound by reading the weights, gains
little from another thread, and stalls whenever one of its threads shares a core
with the driver or Ray: such a step runs on one thread fewer, leaving that core
free. A larger step (prefill, big decode batches) is compute bound and uses all.
Measured on the 2-core CI VM with SmolLM2-135M (fp32): batch 1 decode 18.4 tok/s on
one thread against 16.9 on two; 16 prompts 74 tok/s on one against 92 on two
(``benchmarks/README.md``, section 7).
"""

from __future__ import annotations

import os

import torch

SMALL_STEP_TOKENS = 8  # a step feeding at most this many tokens leaves one core free


def stage_threads(configured: int, workers_on_host: int) -> int:
    """The threads of a stage worker: ``configured``, else the host's cores over its
    ``workers_on_host`` (at least one)."""
    return max(1, configured or (os.cpu_count() or 1) // workers_on_host)


class StepThreads:
    """Sets torch's thread count for each step (only when it changes).

    Call :meth:`for_step` on the thread that runs the step, before computing it.
    """

    def __init__(self, threads: int):
        self.full = threads
        self.small = max(1, threads - 1)
        self._now = 0

    def for_step(self, num_tokens: int) -> int:
        """Apply and return the thread count for a step feeding ``num_tokens`` tokens."""
        wanted = self.small if num_tokens <= SMALL_STEP_TOKENS else self.full
        if wanted != self._now:
            torch.set_num_threads(wanted)
            self._now = wanted
        return wanted
