"""The smallest shim that lets Ray 2.60's compiled graphs use RayPPCommunicator.

Three patches replace four private methods of Ray's channel code
(``ray.experimental.channel.torch_tensor_accelerator_channel`` and ``.common``), only in
the processes that call :func:`apply` (stage actors, and ``raypp bench hop``'s actors),
verified for the Ray versions in ``TESTED_RAY_VERSIONS`` (any other version gets a
warning; ``tests/test_ray_communicator.py::test_ray_internals_the_shim_relies_on_are_unchanged``
fails loudly once Ray's code changes, so the shim is re-checked rather than silently kept):

1. ``_TorchTensorAcceleratorChannel.ensure_registered_as_{writer,reader}`` assert
   that the channel device is not the CPU. That forbids a custom communicator
   from carrying CPU tensors (over gloo). Applied only on CPU workers; the other
   asserts are kept.
2. ``TorchTensorAcceleratorChannel.read`` is not retry-safe: the compiled-graph
   loop reads inputs in ``RAY_CGRAPH_read_iteration_timeout_s`` slices and simply
   calls ``read`` again after a timeout. If the tensors arrived but the CPU part
   did not within the slice, stock Ray drops the received tensors and pairs the
   next execution's tensors with this one's CPU data: silent wrong results, then
   a hang. The replacement keeps received tensors until the CPU part is read.
   Applied on CPU and CUDA (the same code serves NCCL).
3. ``SynchronousReader._read_list`` (the stage loop's input reader) waits for
   each input by blocking channel reads that spin in C++ for up to 0.1 s at a
   time: an idle or waiting stage burns a core. On CPU, where the stages share a
   few cores with the compute they wait for, the replacement reads with
   ``timeout=0`` and sleeps 50 µs–1 ms between passes that found nothing; the
   logic is otherwise Ray's (fail fast on a ``RayTaskError``, leftover channels).
   Safe because every channel raypp's graphs read is retry-safe (patch 2 covers
   the accelerator channel; a shared-memory channel read is all or nothing).
   Applied only on CPU workers.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TESTED_RAY_VERSIONS = ("2.60.0",)
_applied: set[str] = set()


def ray_version_is_tested() -> bool:
    import ray

    return ray.__version__ in TESTED_RAY_VERSIONS


def apply(on_cpu: bool) -> None:
    """Install the shim in this process (idempotent)."""
    import ray

    if not ray_version_is_tested():
        logger.warning(
            "raypp's compiled-graph shim was verified on Ray %s, found %s; applying anyway",
            ", ".join(TESTED_RAY_VERSIONS),
            ray.__version__,
        )
    if "read" not in _applied:
        _patch_retry_safe_read()
        _applied.add("read")
    if on_cpu and "cpu" not in _applied:
        _patch_cpu_device_asserts()
        _patch_sleeping_input_reader()
        _applied.add("cpu")


def _patch_cpu_device_asserts() -> None:
    from ray.experimental.channel import torch_tensor_accelerator_channel as m

    def ensure_registered_as_writer(self: Any) -> None:
        assert self._accelerator_group is not None, "Actor is not part of an accelerator group"
        assert self._writer_registered

    def ensure_registered_as_reader(self: Any) -> bool:
        assert self._accelerator_group is not None, "Actor is not part of an accelerator group"
        assert self._reader_registered
        return True

    m._TorchTensorAcceleratorChannel.ensure_registered_as_writer = ensure_registered_as_writer
    m._TorchTensorAcceleratorChannel.ensure_registered_as_reader = ensure_registered_as_reader


def _patch_retry_safe_read() -> None:
    from ray.experimental.channel import torch_tensor_accelerator_channel as m
    from ray.experimental.channel import utils

    def read(self: Any, timeout: float | None = None) -> Any:
        self.ensure_registered_as_reader()
        if utils.get_self_actor() == self._writer:
            return self._local_channel.read()
        # Tensors received in an earlier, timed-out attempt belong to this value.
        pending = getattr(self, "_raypp_pending_tensors", None)
        if pending is None:
            pending = self._gpu_data_channel.read(timeout)
            self._raypp_pending_tensors = pending
        if self._cpu_data_channel is None:
            assert len(pending) == 1
            data = pending[0]
        else:
            data = self._recv_cpu_and_gpu_data(pending, timeout)
        self._raypp_pending_tensors = None
        return data

    m.TorchTensorAcceleratorChannel.read = read


def _patch_sleeping_input_reader() -> None:
    import time

    import ray
    from ray.exceptions import RayChannelTimeoutError
    from ray.experimental.channel import common

    def _read_list(self: Any, timeout: float | None = None) -> list[Any]:
        self._consume_leftover_channels_if_needed(timeout)
        channels = self._input_channels
        results: list[Any] = [None] * len(channels)
        deadline = None if timeout is None or timeout == -1 else time.monotonic() + timeout
        done: set[int] = set()
        pause = 5e-5
        while len(done) < len(channels):
            progressed = False
            for i, channel in enumerate(channels):
                if i in done:
                    continue
                try:
                    result = channel.read(0)
                except RayChannelTimeoutError:
                    continue
                results[i], progressed = result, True
                done.add(i)
                if isinstance(result, ray.exceptions.RayTaskError):
                    self._leftover_channels = [c for j, c in enumerate(channels) if j not in done]
                    return [result] * len(channels)
            if len(done) == len(channels):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise RayChannelTimeoutError(f"Cannot read all channels within {timeout} seconds")
            if progressed:
                pause = 5e-5
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        return results

    common.SynchronousReader._read_list = _read_list
