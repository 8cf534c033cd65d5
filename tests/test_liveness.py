"""Stuck means no progress, not slow: the driver's progress watch and the stage's counter.

The watch is plain Python (a probe function and a clock are its inputs), so its rules are
checked here on a clock the test advances; the engine-level cases (a slow step completes,
a frozen one is caught, a real 8k-token prompt) are in tests/test_slow_steps.py.
"""

from __future__ import annotations

import pytest
import torch

from raypp.executor.liveness import ProgressWatch
from raypp.model import attention
from raypp.worker.progress import StageProgress, StepProgress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(counts: list[list[int | None]], timeout: float = 3.0):
    """A watch over two stages whose probes answer ``counts`` in turn (last one repeats)."""
    clock = _Clock()
    answers = iter(counts)
    last: list[list[int | None]] = [counts[0]]

    def probe(_timeout: float) -> list[StageProgress | None]:
        last[0] = next(answers, last[0])
        return [None if c is None else StageProgress(c, 7 if i == 1 else None, 1.0)
                for i, c in enumerate(last[0])]

    return ProgressWatch(probe, ["stage 0", "stage 1"], timeout, interval_s=1.0,
                         clock=clock), clock


def _run(watch: ProgressWatch, clock: _Clock, until: float) -> float | None:
    """Advance the clock in 0.25 s slices; the time the watch first says stalled."""
    while clock.now < until:
        clock.now += 0.25
        if watch.stalled():
            return clock.now
    return None


def test_a_moving_counter_is_never_stalled():
    watch, clock = _watch([[i, 5] for i in range(1000)])
    assert _run(watch, clock, 100.0) is None


def test_a_frozen_pipeline_is_stalled_after_the_timeout_and_named():
    watch, clock = _watch([[1, 5], [2, 5], [3, 5], [3, 5]])
    stalled_at = _run(watch, clock, 100.0)
    # the last move was seen at the third probe (t=3): stalled 3 s later, at a probe
    assert stalled_at == 6.0
    text = watch.describe()
    assert "stage 1 inside step 7" in text and "no stage made progress for 3.0 s" in text


def test_no_probe_before_the_first_interval():
    calls = []

    def probe(_timeout: float) -> list[StageProgress | None]:
        calls.append(1)
        return [StageProgress(0, None, 0.0)]

    clock = _Clock()
    watch = ProgressWatch(probe, ["stage 0"], 3.0, interval_s=1.0, clock=clock)
    clock.now = 0.9
    assert not watch.stalled() and not calls  # a short wait costs no probe


def test_a_stage_that_misses_a_probe_is_not_progress_and_is_reported():
    watch, clock = _watch([[1, 5], [1, None], [1, 5], [1, 5], [1, 5]])
    assert _run(watch, clock, 100.0) == 4.0
    watch2, clock2 = _watch([[1, None]])
    _run(watch2, clock2, 100.0)
    assert "no progress report from stage 1" in watch2.describe()


def test_watch_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ProgressWatch(lambda t: [], [], 0)


def test_step_progress_snapshot():
    progress = StepProgress()
    assert progress.snapshot() == StageProgress(0, None, 0.0)
    progress.begin(4)
    progress.tick()
    snap = progress.snapshot()
    assert (snap.count, snap.step_id) == (2, 4) and snap.busy_s >= 0
    progress.end()
    assert progress.snapshot().step_id is None and progress.snapshot().count == 3


@pytest.mark.parametrize("window", [None, 5])
def test_long_attention_in_query_blocks_matches_one_block(monkeypatch, window):
    """A chunk's attention split into blocks of queries (the unit of progress of a long
    prompt) computes what one SDPA call over the chunk computes, and ticks per block."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    layer = attention.PagedAttention(heads, kv_heads, dim, rotary=None, backend="torch",
                                     sliding_window=window)
    seq_len, q_len = 37, 23  # a chunk: the last 23 positions of a 37-token context
    keys = torch.randn(seq_len, kv_heads, dim)
    values = torch.randn(seq_len, kv_heads, dim)
    q = torch.randn(q_len, heads, dim)
    whole = layer._causal(q, keys, values, seq_len)
    ticks = []
    meta = attention.AttentionMetadata(torch.zeros(0, dtype=torch.int64), [0, q_len], [seq_len],
                                       torch.zeros(1, 1, dtype=torch.int64), False,
                                       torch.tensor([seq_len]), on_progress=lambda: ticks.append(1))
    monkeypatch.setattr(attention, "SCORES_PER_BLOCK", heads * seq_len * 5)  # 5 queries a block
    blocks = layer._blocks(q, keys, values, seq_len, meta)
    assert len(blocks) == len(ticks) == 5
    torch.testing.assert_close(torch.cat(blocks), whole)
