"""Stage occupancy: the stages' counters, the windows the engine reports, its periodic
log line and the starved-pipeline advice, ``raypp bench``'s report and ``/metrics``.

The counters' arithmetic is checked on given times; the engine tests run real stages
and assert what holds whatever the machine's speed: every stage counts every step and
token the engine fed, and with one micro-batch in flight two stages never compute at
the same moment, so their busy shares add up to at most one and a stage is idle at
least half the time.
"""

from __future__ import annotations

import logging

import pytest

from raypp import LLM, SamplingParams
from raypp.engine.occupancy import STARVED_IDLE, StageWindow, starved_message, windows
from raypp.worker.occupancy import OccupancyTotals, StageOccupancy


def test_counters_split_busy_wait_and_starved_time():
    occ = StageOccupancy(stage=1)
    occ._counts = (0.0, 0.0, 0, 0, 100.0)  # the last step ended at t=100
    occ.record(submitted_at=101.0, started=103.0, ended=104.0, tokens=8)  # waited 2 s
    occ.record(submitted_at=103.5, started=104.5, ended=106.0, tokens=4)  # waited 0.5 s
    occ.record(submitted_at=0.0, started=110.0, ended=111.0, tokens=1)  # unknown: no wait
    before = OccupancyTotals(1, 100.0, 0.0, 0.0, 0, 0)
    busy, wait, steps, tokens, _ = occ._counts
    after = OccupancyTotals(1, 112.0, busy, wait, steps, tokens)
    [w] = windows([before], [after])
    assert (w.busy, w.bubble, w.steps) == (pytest.approx(3.5 / 12), pytest.approx(2.5 / 12), 3)
    assert w.mean_wait_s == pytest.approx(2.5 / 3) and w.tokens_per_step == pytest.approx(13 / 3)
    assert w.idle == pytest.approx(1 - 3.5 / 12)


def test_the_starved_advice_names_the_most_idle_stage_past_the_threshold():
    def window(stage: int, busy: float) -> StageWindow:
        return StageWindow(stage, 10.0, busy, 0.1, 0.001, 16.0, 100)

    assert starved_message([window(0, 0.9), window(1, 1 - STARVED_IDLE)]) is None
    message = starved_message([window(0, 0.9), window(1, 0.59)])
    assert message is not None and message.startswith("stage 1 idle 41%")
    assert "raise max_num_seqs or use fewer stages" in message


@pytest.fixture(scope="module")
def one_in_flight(ray_cluster, tiny_llama):
    """pp=2 with one micro-batch in flight at a time, a window every 0.2 s."""
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_inflight=1, max_model_len=256,
             stats_interval_s=0.2) as llm:
        yield llm


def test_every_stage_counts_every_step_and_token(one_in_flight):
    llm = one_in_flight
    before = llm.engine.executor.occupancy()
    stats_before = (llm.engine.stats.steps, llm.engine.stats.tokens_processed)
    llm.generate(["The list type", "A"], SamplingParams(temperature=0, max_tokens=24),
                 use_tqdm=False)
    after = llm.engine.executor.occupancy()
    steps = llm.engine.stats.steps - stats_before[0]
    tokens = llm.engine.stats.tokens_processed - stats_before[1]
    assert [a.stage for a in after] == [0, 1]
    for b, a in zip(before, after, strict=True):
        assert (a.steps - b.steps, a.tokens - b.tokens) == (steps, tokens)
    busy = [w.busy for w in windows(before, after)]
    assert all(b > 0 for b in busy)
    assert sum(busy) <= 1.0 + 1e-3  # one micro-batch in flight: never two stages at once


def test_the_engine_logs_its_windows_and_says_when_the_pipeline_starves(one_in_flight, caplog):
    llm = one_in_flight
    with caplog.at_level(logging.INFO, logger="raypp.engine.occupancy"):
        llm.generate(["Assert statements are"], SamplingParams(temperature=0, max_tokens=120,
                                                               ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records]
    assert any("stages busy" in line and "running 1" in line for line in lines), lines
    assert any("pipeline starved" in line for line in lines), lines  # a stage idles >= 50%
    latest = llm.engine.occupancy.latest
    snapshot = llm.engine.stats.snapshot(llm.engine.scheduler, 0, latest)
    assert [w["stage"] for w in snapshot.stage_occupancy] == [0, 1]
    assert max(w["idle"] for w in snapshot.stage_occupancy) >= 0.5 - 1e-3
