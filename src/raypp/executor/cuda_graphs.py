"""CUDA graphs of one stage's decode forward, captured at a fixed set of batch sizes.

A decode step (one query token per sequence) of ``n`` sequences replays the
graph of the smallest captured size ``g >= n``. Rows ``n..g`` are padding: slot
``-1`` (no cache write), context length 0 (zero attention output), token 0 at
position 0; their outputs are computed and dropped (rows never mix in decode).
Steps that are not pure decode, or larger than the largest size, run eagerly.

Every tensor a graph reads lives in :class:`StaticBuffers`. The per-step
integer inputs (ids, positions, slots, lengths, block tables) are written into
one pinned host buffer and moved with two asynchronous copies, so a step costs
no synchronous host-to-device transfer. ``RAYPP_ENFORCE_EAGER=1`` turns capture
off (the worker then never builds a :class:`DecodeGraphs`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from raypp.engine.step import StepInput
from raypp.model.layers import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including ``max_num_seqs``."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


@dataclass
class StaticBuffers:
    """The one place that holds what captured graphs read (views ``[:g]`` of these).

    ``packed`` on the device and ``host`` (pinned) share one layout: ids,
    positions, slots, context lengths (``max_rows`` each), then the block
    tables (``max_rows × width``), all int64.
    """

    max_rows: int
    width: int
    packed: torch.Tensor
    host: torch.Tensor
    hidden_states: torch.Tensor | None  # [max_rows, hidden]: input of a non-first stage
    residual: torch.Tensor | None

    @classmethod
    def allocate(cls, max_rows: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, is_first: bool) -> StaticBuffers:
        size = 4 * max_rows + max_rows * width
        host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        host[2 * max_rows : 3 * max_rows] = -1  # padding rows write no cache slot
        packed = host.to(device)
        hidden = residual = None
        if not is_first:
            hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            residual = torch.zeros_like(hidden)
        return cls(max_rows, width, packed, host, hidden, residual)

    def _field(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i * self.max_rows : (i + 1) * self.max_rows]

    @property
    def input_ids(self) -> torch.Tensor:
        return self._field(self.packed, 0)

    @property
    def positions(self) -> torch.Tensor:
        return self._field(self.packed, 1)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._field(self.packed, 2)

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._field(self.packed, 3)

    @property
    def block_tables(self) -> torch.Tensor:
        return self.packed[4 * self.max_rows :].view(self.max_rows, self.width)


class DecodeGraphs:
    """Captured decode graphs of one stage's model, and the step → replay path."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, is_first: bool,
                 max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, sizes: list[int] | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.is_first = is_first
        self.sizes = sorted(sizes or capture_sizes(max_num_seqs))
        self.max_size = self.sizes[-1]
        self.buffers = StaticBuffers.allocate(self.max_size, max_blocks_per_seq, hidden_size,
                                              dtype, device, is_first)
        self._host = self.buffers.host.numpy()  # writes here land in the pinned buffer
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._copied: torch.cuda.Event | None = None
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)
        self.capture_seconds = 0.0

    # -- capture ---------------------------------------------------------------------------
    def _metadata(self, g: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:g],
            query_start=list(range(g + 1)),
            seq_lens=[1] * g,  # unused on the CUDA decode path (tensors only)
            block_tables=b.block_tables[:g],
            decode_only=True,
            seq_lens_tensor=b.seq_lens[:g],
        )

    def _forward(self, g: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        if self.is_first:
            return self.model(b.positions[:g], meta, self.kv_caches, input_ids=b.input_ids[:g])
        return self.model(b.positions[:g], meta, self.kv_caches,
                          hidden_states=b.hidden_states[:g], residual=b.residual[:g])

    @torch.inference_mode()
    def capture(self) -> DecodeGraphs:
        """Capture every size, largest first, into one shared memory pool."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for g in reversed(self.sizes):
            meta = self._metadata(g)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton JIT, cuBLAS handles
                self._forward(g, meta)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[g] = self._forward(g, meta)
            self._graphs[g] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_size, self.capture_seconds)
        return self

    # -- replay ----------------------------------------------------------------------------
    def can_run(self, step: StepInput) -> bool:
        """True for a pure decode step that fits the captured sizes and table width."""
        n = step.num_seqs
        return (0 < n <= self.max_size and step.num_tokens == n
                and step.query_start == list(range(n + 1))
                and max(len(t) for t in step.block_tables) <= self.buffers.width)

    def graph_size(self, n: int) -> int:
        return next(g for g in self.sizes if g >= n)

    def run(self, step: StepInput, inputs: dict[str, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's forward for ``step`` (``can_run`` must hold): ``(hidden, residual)``.

        On a last stage the returned hidden states are a view of the graph's
        output, valid until the next ``run``; otherwise they are copies.
        """
        n = step.num_seqs
        g = self.graph_size(n)
        self._stage_inputs(step, g)
        b = self.buffers
        if not self.is_first:
            assert inputs is not None
            b.hidden_states[:n].copy_(inputs["hidden_states"])
            b.residual[:n].copy_(inputs["residual"])
        self._graphs[g].replay()
        self.replays += 1
        hidden, residual = self._outputs[g]
        if residual is None:
            return hidden[:n], None
        return hidden[:n].clone(), residual[:n].clone()  # the next replay overwrites them

    def _stage_inputs(self, step: StepInput, g: int) -> None:
        # host: [ids | positions | slots | lens] (max_rows each) + tables [max_rows, width]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        m, n, h = self.max_size, step.num_seqs, self._host
        h[0:n] = step.input_ids
        h[n:g] = 0
        h[m : m + n] = step.positions
        h[m + n : m + g] = 0
        h[2 * m : 2 * m + n] = step.slot_mapping
        h[2 * m + n : 2 * m + g] = -1
        h[3 * m : 3 * m + n] = step.seq_lens
        h[3 * m + n : 3 * m + g] = 0
        width = self.buffers.width
        tables = h[4 * m :].reshape(m, width)
        for row, table in enumerate(step.block_tables):
            tables[row, : len(table)] = table
        b = self.buffers
        b.packed[: 4 * m].copy_(b.host[: 4 * m], non_blocking=True)
        end = 4 * m + g * width
        b.packed[4 * m : end].copy_(b.host[4 * m : end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
