"""FP8 weights as the loader reads them: a checkpoint tensor and its scale, narrowed
together, so a stage reads only its layers' scales and a TP rank only its slice of them.

A *source* (:class:`Fp8Source` for a checkpoint's FP8 weight and scale,
:class:`OnlineSource` for a 16/32-bit weight quantized as it loads) answers one question:
the FP8 values and the scale of every element of a region of the weight. Three *views*
of a source give a layer's ``weight_loader`` what its parameter holds, through the same
``narrow(dim, start, length)`` a plain tensor offers, so TP slicing stays in the layer:

- :meth:`~_Source.dequantized`: ``q · scale`` in fp32 (a 16/32-bit parameter: CPU, or a
  GPU without FP8);
- :meth:`~_Source.fp8`: the e4m3 values of an FP8 parameter, and
  :meth:`~_Source.scales` its ``[rows, G]`` row-group scales (``G`` groups of ``group``
  input columns; ``None``: one per row), narrowed by the weight's coordinates.

A region whose scales are not constant over the parameter's groups (a block checkpoint
read into per-row scales) is re-quantized from its dequantized values.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from raypp.model.quantization import fp8
from raypp.model.quantization.config import QuantConfig


class TensorHandle(Protocol):
    """A checkpoint tensor not yet read (:class:`raypp.model.loader.LazySlice`)."""

    shape: tuple[int, ...]

    def read(self, index: tuple[slice, ...]) -> torch.Tensor: ...


Region = tuple[slice, ...]


def _region(shape: tuple[int, ...], dim: int, start: int, length: int) -> Region:
    index = [slice(0, size) for size in shape]
    index[dim] = slice(start, start + length)
    return tuple(index)


class _Source:
    """What a weight holds in a region: ``(q e4m3, element scales broadcastable to q)``."""

    name: str
    shape: tuple[int, ...]

    def region(self, index: Region) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dequantized(self) -> _View:
        return _View(self.shape, lambda index: fp8.from_fp8(*self.region(index)))

    def fp8(self, group: int | None) -> _View:
        return _View(self.shape, lambda index: self._grouped(index, group)[0])

    def scales(self, group: int | None) -> _View:
        return _View(self.shape, lambda index: self._grouped(index, group)[1])

    def _grouped(self, index: Region, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scale [..., rows, G])`` of the region with one scale per row and group."""
        cols = index[-1]
        if group is not None and cols.start % group:
            raise ValueError(f"{self.name}: a slice starting at input column {cols.start} "
                             f"splits a {group}-column FP8 scale block (tensor parallelism "
                             "must cut weights at block boundaries)")
        q, scale = self.region(index)
        width = cols.stop - cols.start
        full = scale.expand(q.shape).float()
        g = group or width
        pad = -width % g
        padded = torch.nn.functional.pad(full, (0, pad), value=float("nan")) if pad else full
        grid = padded.unflatten(-1, (-1, g))
        hi = grid.nan_to_num(float("-inf")).amax(-1)
        lo = grid.nan_to_num(float("inf")).amin(-1)
        if torch.equal(hi, lo):  # the checkpoint's scales are the parameter's: no rounding
            return q, hi
        values = fp8.from_fp8(q, full)  # re-quantize to the parameter's groups
        per_group = fp8.group_scales(values, group)
        return fp8.to_fp8(values, fp8.expand_scale(per_group, group, width)), per_group


class _View:
    """A weight-shaped view of a source: ``narrow`` returns one kind of tensor."""

    def __init__(self, shape: tuple[int, ...], read: Any):
        self.shape = shape
        self._read = read

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read(_region(self.shape, dim % len(self.shape), start, length))


class Fp8Source(_Source):
    """A checkpoint's FP8 weight with its scale tensor (shape checked against the
    format, naming the scale tensor when it does not fit)."""

    def __init__(self, name: str, weight: TensorHandle, scale_name: str, scale: TensorHandle,
                 quant: QuantConfig, dtype: torch.dtype):
        self.name, self.shape = name, tuple(weight.shape)
        self._weight, self._scale, self._quant = weight, scale, quant
        if dtype != fp8.FP8_DTYPE:
            raise ValueError(f"{name} has a scale ({scale_name}) but is {dtype}, not "
                             "float8_e4m3fn")
        if len(self.shape) < 2:
            raise ValueError(f"{name}: an FP8 weight must be a matrix, got shape {self.shape}")
        want = self._scale_shapes()
        got = tuple(scale.shape)
        if got not in want:
            raise ValueError(f"{scale_name} has shape {list(got)}, but {quant.weights} FP8 "
                             f"scales of {name} {list(self.shape)} have shape "
                             f"{' or '.join(str(list(w)) for w in want)}")
        self._channel_2d = quant.weights == "channel" and len(got) == len(self.shape) - 1

    def _scale_shapes(self) -> list[tuple[int, ...]]:
        *lead, rows, cols = self.shape
        lead = tuple(lead)
        if self._quant.weights == "tensor":
            return [(), (1,)]
        if self._quant.weights == "channel":
            return [(*lead, rows, 1), (*lead, rows)]
        b0, b1 = self._quant.block
        return [(*lead, -(-rows // b0), -(-cols // b1))]

    def region(self, index: Region) -> tuple[torch.Tensor, torch.Tensor]:
        q = self._weight.read(index)
        kind = self._quant.weights
        if kind == "tensor":
            scale = self._scale.read(tuple(slice(0, s) for s in self._scale.shape)).float()
            return q, scale.reshape((1,) * q.dim())
        if kind == "channel":
            if self._channel_2d:
                return q, self._scale.read(index[:-1]).float()[..., None]
            return q, self._scale.read((*index[:-1], slice(0, 1))).float()
        (b0, b1), rows, cols = self._quant.block, index[-2], index[-1]
        grid = self._scale.read((*index[:-2], slice(rows.start // b0, -(-rows.stop // b0)),
                                 slice(cols.start // b1, -(-cols.stop // b1)))).float()
        grid = grid.repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
        r0, c0 = rows.start % b0, cols.start % b1
        return q, grid[..., r0:r0 + rows.stop - rows.start, c0:c0 + cols.stop - cols.start]


class OnlineSource(_Source):
    """A 16/32-bit checkpoint weight quantized as it loads: e4m3 with one scale per
    output row over the whole row (the same at every TP size; a slice of columns reads
    its rows whole to find their scales)."""

    def __init__(self, name: str, weight: TensorHandle):
        self.name, self.shape = name, tuple(weight.shape)
        self._weight = weight

    def region(self, index: Region) -> tuple[torch.Tensor, torch.Tensor]:
        whole_rows = (*index[:-1], slice(0, self.shape[-1]))
        q, scale = fp8.quantize_rows(self._weight.read(whole_rows), None)
        return q[..., index[-1]], scale


def scale_names(names: set[str], quant: QuantConfig) -> dict[str, str]:
    """Weight name → its scale tensor's name, for every checkpoint weight that has one."""
    suffix = "." + quant.scale_name
    out = {}
    for name in names:
        if name.endswith(suffix):
            weight = name[: -len(suffix)] + ".weight"
            if weight in names:
                out[weight] = name
    return out


_KV_SCALE_SUFFIXES = {".self_attn.k_scale": "k_scale", ".self_attn.v_scale": "v_scale",
                      ".self_attn.k_proj.output_scale": "k_scale",
                      ".self_attn.v_proj.output_scale": "v_scale"}


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """``(the layer's attention prefix "model.layers.<i>.self_attn", "k_scale" |
    "v_scale")`` for a checkpoint's per-layer KV-cache scale, else ``None``."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix) and name.startswith("model.layers."):
            return name[: -len(suffix)] + ".self_attn", which
    return None


def is_companion(name: str, quant: QuantConfig | None) -> bool:
    """A tensor that loads with its weight, not on its own: a weight scale or an
    activation's ``input_scale``."""
    if quant is None:
        return False
    return name.endswith(".input_scale") or name.endswith("." + quant.scale_name)
