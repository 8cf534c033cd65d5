"""Launch settings of the Triton kernels, keyed by device and shape class.

Each table holds the settings a measured sweep chose on one GPU model (the
device's name as CUDA reports it, e.g. ``"NVIDIA H200"``); a GPU with no table
gets :data:`UNTUNED`'s settings, which are correct everywhere and reasonable on
any GPU with 100 KB of shared memory per block or more — never another GPU's
tuning. The sweeps live in ``benchmarks/kernels/`` and their runs in
``benchmarks/gpu/``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton


class DecodeLaunch(NamedTuple):
    """How the paged decode attention kernels run: context tokens per inner
    iteration, warps, and software-pipeline stages of their loads."""

    block: int = 64
    num_warps: int = 4
    num_stages: int = 2


class GemvConfig(NamedTuple):
    block_n: int  # rows of w per program
    block_k: int  # K per tile
    num_warps: int


class GemmConfig(NamedTuple):
    block_n: int  # rows of w per program
    block_k: int  # K per tile
    split_k: int  # programs along K (their fp32 partials summed by the last to arrive)
    num_warps: int
    num_stages: int  # tiles in flight (shared memory)


class ShapeClass(NamedTuple):
    """What the tables key a projection by: gated (gate/up fused), K at least 4096
    (a down projection of a 1B-class model), N above K (up-projecting), else square-ish."""

    gated: bool
    deep_k: bool
    wide_n: bool

    @classmethod
    def of(cls, n: int, k: int, gated: bool) -> ShapeClass:
        return cls(gated, not gated and k >= 4096, not gated and k < 4096 and n > k)


class DeviceTables(NamedTuple):
    """One GPU model's measured settings. ``gemv``/``gemm`` map a shape class to 2-byte
    weights' settings (4-byte weights halve the K tile); ``gemm_wide`` holds the
    settings for more than 32 rows."""

    decode_launch: DecodeLaunch
    decode_launch_batch1: DecodeLaunch
    gemv: dict[ShapeClass, GemvConfig]
    gemm: dict[ShapeClass, GemmConfig]
    gemm_wide: dict[ShapeClass, GemmConfig]


def _classes(gated, deep, wide, square) -> dict[ShapeClass, object]:
    return {ShapeClass(True, False, False): gated, ShapeClass(False, True, False): deep,
            ShapeClass(False, False, True): wide, ShapeClass(False, False, False): square}


# The H200 (141 GB HBM3e, 132 SMs), sweeps at the Llama-3.2-1B shapes with PDL:
# attention launch (benchmarks/gpu run 6: within 4 % of each batch's fastest over
# batch 1..256), GEMV (run 7), GEMM at 32 and 64 rows (run 9).
_H200 = DeviceTables(
    decode_launch=DecodeLaunch(64, 2, 2),
    decode_launch_batch1=DecodeLaunch(64, 4, 2),
    gemv=_classes(GemvConfig(4, 512, 4), GemvConfig(2, 2048, 8), GemvConfig(2, 1024, 4),
                  GemvConfig(4, 2048, 4)),
    gemm=_classes(GemmConfig(32, 256, 1, 4, 3), GemmConfig(32, 128, 4, 4, 4),
                  GemmConfig(32, 128, 4, 4, 4), GemmConfig(32, 256, 4, 4, 4)),
    gemm_wide=_classes(GemmConfig(64, 128, 1, 4, 4), GemmConfig(32, 256, 2, 4, 4),
                       GemmConfig(32, 128, 4, 4, 3), GemmConfig(32, 256, 2, 4, 4)),
)

# Any other GPU: small tiles and two stages, so shared memory fits everywhere.
UNTUNED = DeviceTables(
    decode_launch=DecodeLaunch(64, 4, 2),
    decode_launch_batch1=DecodeLaunch(64, 4, 2),
    gemv=_classes(*[GemvConfig(4, 512, 4)] * 4),
    gemm=_classes(*[GemmConfig(32, 128, 2, 4, 2)] * 4),
    gemm_wide=_classes(*[GemmConfig(32, 128, 2, 4, 2)] * 4),
)

TABLES: dict[str, DeviceTables] = {"NVIDIA H200": _H200}


@functools.cache
def device_name(device: torch.device) -> str:
    """CUDA's name of the device (``"cpu"`` for Triton's interpreter on a CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def tables(device: torch.device) -> DeviceTables:
    """The measured tables of ``device``'s GPU model, else :data:`UNTUNED`."""
    return TABLES.get(device_name(device), UNTUNED)


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter (tests on CPU): behave like an H100/H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_launch(device: torch.device, num_seqs: int) -> DecodeLaunch:
    t = tables(device)
    return t.decode_launch_batch1 if num_seqs == 1 else t.decode_launch


def gemv_config(device: torch.device, n: int, k: int, gated: bool,
                dtype: torch.dtype) -> GemvConfig:
    """Settings of :func:`raypp.kernels.linear.gemv` for ``w`` of ``[n (x2 gated), k]``."""
    bn, bk, warps = tables(device).gemv[ShapeClass.of(n, k, gated)]
    bk = min(bk // (2 if dtype.itemsize > 2 else 1), triton.next_power_of_2(k))
    return GemvConfig(bn, bk, warps)


def gemm_config(device: torch.device, m: int, n: int, k: int, gated: bool,
                dtype: torch.dtype) -> GemmConfig:
    """Settings of :func:`raypp.kernels.linear.gemm` for ``m`` rows and ``w`` of
    ``[n (x2 gated), k]``."""
    t = tables(device)
    bn, bk, split, warps, stages = (t.gemm_wide if m > 32 else t.gemm)[ShapeClass.of(n, k, gated)]
    if dtype.itemsize > 2:
        bk, stages = bk // 2, min(stages, 3)
    return GemmConfig(bn, max(16, min(bk, triton.next_power_of_2(k))), split, warps, stages)
