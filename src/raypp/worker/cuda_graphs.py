"""CUDA graphs of one stage's decode forward, captured at a fixed set of batch sizes.

A decode step (one query token per sequence) of ``n`` sequences replays the
graph of the smallest captured size ``g >= n``. Rows ``n..g`` are padding: slot
``-1`` (no cache write), context length 0 (zero attention output), token 0 at
position 0; their outputs are computed and dropped (rows never mix in decode).
Steps that are not pure decode, or larger than the largest size, run eagerly.
On the last stage the graph ends with the LM head: it outputs every row's logits.

The captured forward is ``torch.compile``-d first (unless ``compile=False``):
Inductor fuses the many small element-wise kernels of a layer (RMSNorm, rotary,
SiLU·mul, casts) while the paged attention stays one opaque custom op. One
compilation with a dynamic batch dimension serves every size (plus one for batch
1); a size whose compilation fails is captured from the eager forward instead.
Sizes up to ``fused_max_rows`` (``RuntimeConfig.fused_decode_max_rows``) capture the
model family's fused Triton kernel chain instead (``fused_decode_forward``, see
:class:`raypp.model.base.StageModel`), where the stage has one.

Every tensor a graph reads lives in :class:`StaticBuffers`. The per-step integer
inputs (ids, positions, slots, lengths, block tables) are written into one
pinned host buffer and copied asynchronously, so a step costs no synchronous
host-to-device transfer. ``enforce_eager`` turns graphs off (the worker then never
builds a :class:`DecodeGraphs`); ``compile_decode=False`` keeps graphs but skips
``torch.compile``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from raypp.model.attention import AttentionMetadata
from raypp.step import ResolvedStep, StageHandoff
from raypp.worker.decode_loop import DecodeInputs

logger = logging.getLogger(__name__)

_INT_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")
_PAD_VALUES = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0}


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including ``max_num_seqs``."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


@dataclass
class StaticBuffers:
    """The one place that holds what captured graphs read (views ``[:g]`` of these).

    ``host`` (pinned) stages every integer input in one layout: ids, positions,
    slots, context lengths (``max_rows`` each), then the block tables
    (``max_rows × width``), all int64; each device tensor is its own allocation.
    """

    max_rows: int
    width: int
    host: torch.Tensor
    input_ids: torch.Tensor  # [max_rows] int64
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # [max_rows, width] int64
    hidden_states: torch.Tensor | None  # [max_rows, hidden]: input of a non-first stage
    residual: torch.Tensor | None

    @classmethod
    def allocate(cls, max_rows: int, width: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, is_first: bool) -> StaticBuffers:
        host = torch.zeros(4 * max_rows + max_rows * width, dtype=torch.int64,
                           pin_memory=device.type == "cuda")  # CPU: the loader's tests
        ints = {name: torch.full((max_rows,), _PAD_VALUES[name], dtype=torch.int64,
                                 device=device) for name in _INT_FIELDS}
        tables = torch.zeros(max_rows, width, dtype=torch.int64, device=device)
        hidden = residual = None
        if not is_first:
            hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            residual = torch.zeros_like(hidden)
        return cls(max_rows, width, host, block_tables=tables, hidden_states=hidden,
                   residual=residual, **ints)


def decode_forward(model: Any, kv_caches: list[torch.Tensor], positions: torch.Tensor,
                   slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, input_ids: torch.Tensor | None,
                   hidden_states: torch.Tensor | None, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stage's forward for a decode batch, from tensors only (what gets compiled)."""
    meta = AttentionMetadata(slot_mapping=slot_mapping, query_start=[], seq_lens=[],
                             block_tables=block_tables, decode_only=True,
                             seq_lens_tensor=seq_lens)  # the CUDA decode path reads tensors only
    return model(positions, meta, kv_caches, input_ids=input_ids, hidden_states=hidden_states,
                 residual=residual)


def _fused_forward(model: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`decode_forward`'s contract through the model's fused kernel chain."""
    return model.fused_decode_forward(*args)


class DecodeGraphs:
    """Captured decode graphs of one stage's model, and the step → replay path."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, is_first: bool,
                 is_last: bool, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, sizes: list[int] | None = None,
                 compile_forward: bool = True, fused_max_rows: int = 64):
        self.model = model
        self.kv_caches = kv_caches
        self.is_first, self.is_last = is_first, is_last
        self.sizes = sorted(sizes or capture_sizes(max_num_seqs))
        self.max_size = self.sizes[-1]
        self.buffers = StaticBuffers.allocate(self.max_size, max_blocks_per_seq, hidden_size,
                                              dtype, device, is_first)
        self._host = self.buffers.host.numpy()  # writes here land in the pinned buffer
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}  # logits (last stage) or (hidden, residual)
        self._loaded = (0, 0)  # (graph size, rows) of the inputs now in the buffers
        self._copied: torch.cuda.Event | None = None
        self._compiled = torch.compile(decode_forward, fullgraph=True) if compile_forward else None
        self.compiled_sizes: list[int] = []  # sizes whose graph holds the compiled forward
        self.compile_error: str | None = None
        self.fused_sizes: list[int] = []  # sizes whose graph holds the fused kernel chain
        self.fused_max_rows = min(fused_max_rows, model.fused_decode_max_rows)
        self.fused_unsupported = (model.fused_decode_unsupported() if fused_max_rows > 0
                                  else "disabled")
        self.replays = 0  # steps served by a graph (tests and benchmarks read it)
        self.capture_seconds = 0.0

    # -- capture ---------------------------------------------------------------------------
    def _args(self, g: int) -> tuple[Any, ...]:
        b = self.buffers
        rows = [b.positions[:g], b.slot_mapping[:g], b.block_tables[:g], b.seq_lens[:g],
                b.input_ids[:g] if self.is_first else None,
                None if self.is_first else b.hidden_states[:g],
                None if self.is_first else b.residual[:g]]
        return (self.model, self.kv_caches, *rows)

    def _warm(self, g: int) -> Any:
        """Run size ``g`` once outside capture (compiling it, creating cuBLAS handles, the
        LM head's too: none can be made during capture); returns the forward to capture."""
        forward, out = self._first_run(g)
        if self.is_last:
            self.model.compute_logits(out[0])
        return forward

    def _first_run(self, g: int) -> tuple[Any, Any]:
        """``(forward, its output)`` for size ``g``: the fused chain up to
        ``fused_max_rows``, else the compiled forward, else (compilation failed) the eager
        one."""
        args = self._args(g)
        if g <= self.fused_max_rows and self.fused_unsupported is None:
            out = _fused_forward(*args)
            self.fused_sizes.append(g)
            return _fused_forward, out
        if self._compiled is not None and self.compile_error is None:
            if g >= 2:  # one graph with a symbolic batch serves every size >= 2
                for t in args[2:]:
                    if t is not None:
                        torch._dynamo.mark_dynamic(t, 0)
            try:
                out = self._compiled(*args)
                self.compiled_sizes.append(g)
                return self._compiled, out
            except Exception as e:  # noqa: BLE001 - fall back to the eager forward
                self.compile_error = f"{type(e).__name__}: {e}"
                logger.warning("torch.compile of the decode forward failed (%s); capturing "
                               "the eager forward", self.compile_error)
        return decode_forward, decode_forward(*args)

    @torch.inference_mode()
    def capture(self) -> DecodeGraphs:
        """Capture every size, largest first, into one shared memory pool."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for g in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compilation, Triton JIT, cuBLAS handles
                forward = self._warm(g)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = forward(*self._args(g))
                self._outputs[g] = self.model.compute_logits(out[0]) if self.is_last else out
            self._graphs[g] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured %d decode CUDA graphs (batch %d..%d, %d compiled, %d fused) in "
                    "%.1f s", len(self.sizes), self.sizes[0], self.max_size,
                    len(self.compiled_sizes), len(self.fused_sizes), self.capture_seconds)
        return self

    # -- replay ----------------------------------------------------------------------------
    def can_run(self, step: ResolvedStep) -> bool:
        """True for a pure decode step that fits the captured sizes and table width."""
        n = step.num_seqs
        return (0 < n <= self.max_size and step.num_tokens == n
                and step.query_start == list(range(n + 1))
                and max(len(t) for t in step.block_tables) <= self.buffers.width)

    def graph_size(self, n: int) -> int:
        return next(g for g in self.sizes if g >= n)

    def run(self, step: ResolvedStep, handoff: StageHandoff | None) -> Any:
        """The stage's forward for ``step`` (``can_run`` must hold); ``handoff``: the
        previous stage's activations (``None`` on the first stage).

        A last stage returns every row's logits ``[rows, vocab]``, a view valid
        until the next replay; other stages return copies of ``(hidden, residual)``.
        """
        self.load(step, handoff)
        out = self.replay()
        return out if self.is_last else (out[0].clone(), out[1].clone())

    def load(self, step: ResolvedStep, handoff: StageHandoff | None = None) -> DecodeInputs:
        """Stage ``step``'s inputs; returns views of the buffers the graph reads."""
        n = step.num_seqs
        g = self.graph_size(n)
        self._stage_inputs(step, g)
        b = self.buffers
        if not self.is_first:
            if handoff is None:
                raise ValueError(f"step {step.step_id}: a stage after the first needs the "
                                 "previous stage's hand-off")
            b.hidden_states[:n].copy_(handoff.hidden_states)
            b.residual[:n].copy_(handoff.residual)
        self._loaded = (g, n)
        return DecodeInputs(b.input_ids[:n], b.positions[:n], b.slot_mapping[:n], b.seq_lens[:n],
                            b.block_tables[:n])

    def replay(self) -> Any:
        """Replay on the buffers as they are now: the loaded rows' outputs (views)."""
        g, n = self._loaded
        self._graphs[g].replay()
        self.replays += 1
        out = self._outputs[g]
        return out[:n] if self.is_last else (out[0][:n], out[1][:n])

    def _stage_inputs(self, step: ResolvedStep, g: int) -> None:
        # host: [ids | positions | slots | lens] (max_rows each) + tables [max_rows, width]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffer
        m, n, h = self.max_size, step.num_seqs, self._host
        values = (step.input_ids, step.positions, step.slot_mapping, step.seq_lens)
        for i, (name, vals) in enumerate(zip(_INT_FIELDS, values, strict=True)):
            h[i * m : i * m + n] = vals
            h[i * m + n : i * m + g] = _PAD_VALUES[name]
        width = self.buffers.width
        tables = h[4 * m :].reshape(m, width)
        for row, table in enumerate(step.block_tables):
            tables[row, : len(table)] = table
        b, host = self.buffers, self.buffers.host
        for i, name in enumerate(_INT_FIELDS):
            getattr(b, name)[:g].copy_(host[i * m : i * m + g], non_blocking=True)
        b.block_tables[:g].copy_(host[4 * m : 4 * m + g * width].view(g, width), non_blocking=True)
        if b.input_ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
