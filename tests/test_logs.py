"""Quiet logs: an idle period's compiled-graph teardown and recompile log nothing above
DEBUG (Ray's lines included), and Ray's errors about workers raypp killed on purpose are
dropped. (A timeout's single ERROR line: tests/test_faults.py.)"""

from __future__ import annotations

import logging

import pytest

from raypp import LLM, SamplingParams
from raypp.executor.ray_logs import quiet_ray_logs
from raypp.testing import wait_suspended

RAY_LOGGERS = ["ray.dag.compiled_dag_node",
               "ray.experimental.channel.torch_tensor_accelerator_channel"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def ray_records():
    """What reaches handlers on Ray's compiled-graph loggers (after their filters)."""
    quiet_ray_logs()
    handler = _Records()
    loggers = [logging.getLogger(name) for name in RAY_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def _record(name: str, level: int, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.getLogger(name).makeRecord(
        name, level, __file__, 1, msg, (), (type(exc), exc, None) if exc else None)


def test_the_filter_demotes_info_and_drops_deliberate_kills(ray_records):
    logger = logging.getLogger(RAY_LOGGERS[0])
    logger.handle(_record(RAY_LOGGERS[0], logging.INFO, "Tearing down compiled DAG"))
    assert ray_records == []  # raypp is not at DEBUG
    cause = RuntimeError("The actor is dead because it was killed by `ray.kill`.")
    wrapped = RuntimeError("Error cancelling worker task")
    wrapped.__context__ = cause
    logger.handle(_record(RAY_LOGGERS[0], logging.ERROR, "Error cancelling worker task", wrapped))
    assert ray_records == []
    logger.handle(_record(RAY_LOGGERS[0], logging.ERROR, "something else broke"))
    assert [r.getMessage() for r in ray_records] == ["something else broke"]
    raypp = logging.getLogger("raypp")
    level = raypp.level
    raypp.setLevel(logging.DEBUG)
    try:
        logger.handle(_record(RAY_LOGGERS[0], logging.INFO, "Teardown complete"))
    finally:
        raypp.setLevel(level)
    assert ray_records[-1].levelname == "DEBUG" and ray_records[-1].getMessage() == "Teardown complete"


def test_an_idle_period_logs_nothing_above_debug(ray_cluster, tiny_llama, ray_records, caplog):
    """pp=2 (the PP edges' communicator is set up at each compile): after the first step,
    an idle teardown and the recompile of the next request log only DEBUG records."""
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, idle_suspend_s=0.5) as llm:
        llm.generate("The list type", params, use_tqdm=False)
        ray_records.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert wait_suspended(llm.engine.executor)
            llm.generate("The list type", params, use_tqdm=False)  # recompiles
            assert wait_suspended(llm.engine.executor)
        noisy = [r.getMessage() for r in [*ray_records, *caplog.records] if r.levelno > logging.DEBUG]
        assert noisy == []
