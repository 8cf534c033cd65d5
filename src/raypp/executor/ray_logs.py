"""Ray's log records that raypp's own use of Ray makes noisy, quieted in the driver.

What callers may rely on, once :func:`quiet_ray_logs` ran (idempotent):

- Ray's compiled-graph INFO lines (``ray.dag.compiled_dag_node``: tearing down,
  cancelling, waiting, complete; the PP edges' communicator group initialized at each
  compile) are DEBUG records, shown only while raypp logs at DEBUG: raypp tears an idle
  graph down and recompiles it on the next step (``idle_suspend_s``), so they came with
  every idle period.
- Ray's errors about an actor raypp killed on purpose (``ray.kill`` of a stuck or
  replaced stage worker: "The actor is dead because it was killed by `ray.kill`") are
  dropped; raypp's own ERROR line says what failed and why.
"""

from __future__ import annotations

import logging

_LOGGERS = ("ray.dag.compiled_dag_node",
            "ray.experimental.channel.torch_tensor_accelerator_channel")
_KILLED = "killed by `ray.kill`"


class _QuietRay(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if killed_on_purpose(record):
            return False
        if record.levelno == logging.INFO:
            if not logging.getLogger("raypp").isEnabledFor(logging.DEBUG):
                return False
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def killed_on_purpose(record: logging.LogRecord) -> bool:
    """True when the record's exception (or one it was raised from) reports an actor
    killed with ``ray.kill``."""
    exc = record.exc_info[1] if record.exc_info else None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _KILLED in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return _KILLED in record.getMessage()


def quiet_ray_logs() -> None:
    """Install the filter on Ray's compiled-graph loggers (once per process)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietRay) for f in logger.filters):
            logger.addFilter(_QuietRay())
