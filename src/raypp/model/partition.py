"""Which contiguous layers each pipeline stage owns.

:func:`stage_partition` is the one rule, in order:

1. an explicit partition (``ParallelConfig.layer_partition``) wins;
2. a model whose layers all hold the same parameter bytes is split evenly by layer
   count, earlier stages taking the remainder (what raypp has always done);
3. a model whose layers differ in size (mixture-of-experts layers beside dense ones) is
   split by parameter bytes: the partition with the smallest largest stage, counting the
   embedding on the first stage and the final norm and LM head on the last, and of those
   the one with the largest smallest stage (:func:`balance_by_bytes`).

Bytes come from the family's own stage model, built for the whole model on the meta
device (no memory, no weights read): what a worker allocates is what is counted
(:func:`weight_layout`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from raypp.model.base import StageSpec
from raypp.model.layers import TPContext
from raypp.model.quantization.linear import Fp8Format
from raypp.model.registry import model_class


@dataclass(frozen=True)
class WeightLayout:
    """Parameter bytes of a model at TP 1: ``first`` only the first stage holds (the
    embedding), ``layers[i]`` global layer ``i``'s, ``last`` only the last stage holds (the
    final norm and LM head, a copy of the embedding when tied)."""

    first: int
    layers: tuple[int, ...]
    last: int

    def stage_bytes(self, bounds: list[tuple[int, int]]) -> list[int]:
        """Parameter bytes of each stage ``[start, end)`` of ``bounds``."""
        n = len(self.layers)
        return [sum(self.layers[a:b]) + (self.first if a == 0 else 0) + (self.last if b == n else 0)
                for a, b in bounds]


def weight_layout(hf_config: dict, architecture: str, dtype: torch.dtype,
                  fp8: Fp8Format | None = None) -> WeightLayout:
    """The :class:`WeightLayout` of a checkpoint's config, from the family's stage model
    built on the meta device (``fp8``: with FP8 linear layers)."""
    return _weight_layout(json.dumps(hf_config, sort_keys=True), architecture, dtype, fp8)


@functools.lru_cache(maxsize=8)
def _weight_layout(config_json: str, architecture: str, dtype: torch.dtype,
                   fp8: Fp8Format | None) -> WeightLayout:
    cfg = json.loads(config_json)
    n = int(cfg["num_hidden_layers"])
    with torch.device("meta"):
        model = model_class(architecture)(cfg, StageSpec(0, n, True, True), TPContext(), dtype,
                                          "torch", quant=fp8)
    first, last, layers = 0, 0, [0] * n
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += size
        elif name.startswith("model.embed_tokens."):
            first += size
        else:
            last += size
    return WeightLayout(first, tuple(layers), last)


def balance_by_bytes(layout: WeightLayout, pp: int) -> list[int]:
    """Layers per stage: the contiguous split of ``layout`` into ``pp`` stages of at least
    one layer whose largest stage holds the fewest bytes, and of those, the one whose
    smallest stage holds the most."""
    n = len(layout.layers)
    prefix = [0]
    for size in layout.layers:
        prefix.append(prefix[-1] + size)

    def cost(i: int, j: int) -> int:  # stage of layers [i, j)
        return prefix[j] - prefix[i] + (layout.first if i == 0 else 0) + (layout.last if j == n else 0)

    inf = float("inf")
    # worst[s][j]: the smallest largest stage of s stages over layers [0, j)
    worst = [[inf] * (n + 1) for _ in range(pp + 1)]
    worst[0][0] = 0
    for s in range(1, pp + 1):
        for j in range(s, n + 1):
            worst[s][j] = min(max(worst[s - 1][i], cost(i, j)) for i in range(s - 1, j))
    bound = worst[pp][n]
    # best[s][j]: the largest smallest stage, every stage within the bound; prev: its split
    best = [[-inf] * (n + 1) for _ in range(pp + 1)]
    prev = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = inf
    for s in range(1, pp + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                c = cost(i, j)
                if c <= bound and best[s - 1][i] > -inf and min(best[s - 1][i], c) > best[s][j]:
                    best[s][j], prev[s][j] = min(best[s - 1][i], c), i
    sizes, j = [], n
    for s in range(pp, 0, -1):
        i = prev[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def partition_layers(num_layers: int, pp_size: int,
                     override: list[int] | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of ``override`` (layers per stage), else split as
    evenly as possible, earlier stages taking the remainder (the last also runs the LM
    head). ``ValueError`` when a stage would have no layer or ``override`` does not fit."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
            "each stage needs at least one layer"
        )
    if override is not None:
        if len(override) != pp_size or sum(override) != num_layers or min(override) < 1:
            raise ValueError(
                f"layer partition {override} must have {pp_size} positive entries summing to "
                f"{num_layers}"
            )
        sizes = list(override)
    else:
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if i < extra else 0) for i in range(pp_size)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def stage_partition(hf_config: dict, architecture: str, dtype: torch.dtype, pp_size: int,
                    override: list[int] | None = None,
                    fp8: Fp8Format | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` global layers of each stage, by the rule in the module docstring
    (``fp8``: the workers hold FP8 linear layers, one byte per weight)."""
    num_layers = int(hf_config["num_hidden_layers"])
    if override is None and 1 < pp_size <= num_layers:
        layout = weight_layout(hf_config, architecture, dtype, fp8)
        if len(set(layout.layers)) > 1:
            override = balance_by_bytes(layout, pp_size)
    return partition_layers(num_layers, pp_size, override)
