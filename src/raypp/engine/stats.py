"""EngineStats: the one record of how an engine is doing.

:class:`~raypp.engine.engine.LLMEngine` keeps the cumulative counters in
``engine.stats`` as it steps. The load fields (requests, KV blocks, prefix cache)
describe one moment: :meth:`EngineStats.snapshot` fills them in a copy, which is what
:class:`~raypp.engine.async_engine.AsyncLLMEngine` publishes after every loop
iteration and the server's ``/metrics`` reads. In ``engine.stats`` itself they stay 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypp.engine.occupancy import StageWindow
    from raypp.engine.scheduler import Scheduler


@dataclass
class EngineStats:
    """Counters since start-up and, in a :meth:`snapshot`, the load at one moment."""

    # cumulative since start-up, updated by the engine's step
    steps: int = 0  # step results read
    tokens_processed: int = 0  # tokens fed through the pipeline (prefill + decode)
    tokens_generated: int = 0
    step_time_s: float = 0.0  # wall time waiting on step results
    max_step_wait_s: float = 0.0  # longest single wait for a step result
    overhead_time_s: float = 0.0  # scheduling, descriptor building, postprocessing
    rounds_ahead: int = 0  # decode rounds submitted before the round they continue was read
    # speculative decoding: rows verified with a draft, tokens drafted, of which accepted
    spec_verifications: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the load at one moment: filled by snapshot()
    running: int = 0  # requests with at least one sequence running
    waiting: int = 0  # requests queued, none of their sequences running yet
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # of which found there
    prefill_chunks_overlapped: int = 0  # prompt chunks that entered while earlier ones were in flight
    # per stage, the latest occupancy window (StageWindow.as_dict; raypp.engine.occupancy)
    stage_occupancy: list[dict[str, Any]] = field(default_factory=list)

    def snapshot(self, scheduler: Scheduler, num_requests: int,
                 stages: Sequence[StageWindow] = ()) -> EngineStats:
        """A copy of these counters with the load of ``scheduler`` (and its block
        manager), ``num_requests`` unfinished requests and the stages' latest occupancy
        windows filled in."""
        running = len({seq.request_id for seq in scheduler.running})
        return replace(
            self, running=running, waiting=max(0, num_requests - running),
            kv_blocks_used=scheduler.blocks.num_used, kv_blocks_total=scheduler.blocks.num_blocks,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            prefill_chunks_overlapped=scheduler.num_overlapped_chunks,
            stage_occupancy=[w.as_dict() for w in stages])

    def summary(self) -> str:
        """One line of a snapshot's load, for the engine's periodic log."""
        return (f"running {self.running}, waiting {self.waiting}, KV blocks "
                f"{self.kv_blocks_used}/{self.kv_blocks_total}, {self.tokens_generated} "
                f"tokens generated")
