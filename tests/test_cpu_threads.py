"""CPU stage threads: small steps leave a core free, large ones use every thread."""

from __future__ import annotations

import torch

from raypp.worker.cpu_threads import SMALL_STEP_TOKENS, StepThreads, stage_threads


def test_small_steps_run_on_one_thread_fewer():
    before = torch.get_num_threads()
    try:
        threads = StepThreads(3)
        assert threads.for_step(1) == 2 and torch.get_num_threads() == 2
        assert threads.for_step(SMALL_STEP_TOKENS) == 2
        assert threads.for_step(SMALL_STEP_TOKENS + 1) == 3 and torch.get_num_threads() == 3
        assert StepThreads(1).for_step(1) == 1  # never below one
    finally:
        torch.set_num_threads(before)


def test_stage_threads_default_to_the_cores_over_the_workers(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert stage_threads(0, 4) == 4
    assert stage_threads(0, 32) == 1
    assert stage_threads(6, 4) == 6
