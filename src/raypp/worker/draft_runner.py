"""The first stage's draft model: its weights, its KV cache, and drafting inside the
step that verifies the draft.

**Where the draft runs.** A ``VERIFY`` step's drafting rows reach the first stage
ending in placeholders (:mod:`raypp.engine.draft_proposer`); before the target runs,
:meth:`DraftRunner.run` drafts their tokens greedily and writes them there, and the
step's activations carry them on (:attr:`raypp.step.StageHandoff.drafts`) so the last
stage verifies exactly them. Drafting at the start of the verifying step, rather than
as a step kind of its own, keeps the one step shape every proposer uses (rows ending in
drafted tokens, ``StepInput.draft_lens``) and costs no extra round trip: a separate
draft step would go driver → first stage → driver before the verification could be
submitted, and on the compiled-graph plane every step runs every stage. The draft is
greedy (the argmax of the draft's logits), a deterministic draft, which the last
stage's acceptance rule handles exactly (:mod:`raypp.worker.verifier`): outputs never
depend on the draft, only how many tokens each step accepts does.

**Its KV.** The draft has its own cache tensors, one per draft layer, with as many
blocks as the target's and indexed by the same block tables, so a position's draft KV
sits in the slot of its target KV. On every step that is not a decode round,
:meth:`DraftRunner.run` first feeds the draft each row's catch-up tokens
(``StepInput.draft_catchup``: accepted tokens it has not seen) and the row's own input
tokens up to its placeholders (prompt chunks, plain decode rows and a drafting row's
last token alike), in one forward; then one more single-token forward per further
drafted position. So the draft sees every token the target accepted, prefill included;
positions the target rejected are overwritten later, as the target's are.

**Speed.** One forward per drafted position, batched over the step's drafting rows. On
CUDA (unless ``enforce_eager``) the draft has decode CUDA graphs of its own
(:class:`raypp.worker.cuda_graphs.DecodeGraphs` over its cache, captured by the worker
beside the target's): every forward of one token per row (the drafted positions after the
first, and a first pass whose rows are all plain decodes without catch-up) replays one;
prompt chunks and catch-up tokens run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raypp.config import EngineConfig
from raypp.model.attention import attention_backend
from raypp.model.base import StageModel, StageSpec
from raypp.model.layers import TPContext
from raypp.model.loader import load_stage_weights
from raypp.model.quantization.linear import weight_format
from raypp.model.registry import model_class
from raypp.step import ResolvedStep, StepInput, StepMode
from raypp.worker.eager_metadata import attention_metadata
from raypp.worker.kv_memory import zeros


@dataclass
class DraftModel:
    """A loaded draft model (every layer of it, this TP rank's shard) on the first
    stage; :meth:`runner` gives it a KV cache."""

    model: StageModel
    path: str
    kv_dtype: torch.dtype  # its cache's element type (the target's kv_cache_dtype choice)
    report: dict[str, Any]  # for the stage table: path, layers, weight and block bytes

    @classmethod
    def load(cls, config: EngineConfig, stage: StageSpec, device: torch.device,
             tp: TPContext) -> DraftModel | None:
        """The draft of ``config`` for ``stage``, loaded onto ``device`` in the target's
        dtype with the target's loader (safetensors or GGUF; an FP8 checkpoint in its own
        format, as the target's would be; a Hub id fetched on this node as the target's
        is); ``None`` unless ``stage`` is the first and ``config`` asks for a draft model.
        Its KV cache takes the target's ``kv_cache_dtype``."""
        spec = config.speculative_config
        draft = spec.draft if spec is not None else None
        if draft is None or not stage.is_first:
            return None
        whole = StageSpec(0, draft.num_layers, True, True)
        fp8 = weight_format(draft.quant_config, device)  # None: 16/32-bit (CPU dequantizes)
        with torch.device(device):
            model = model_class(draft.architecture)(draft.hf_config, whole, tp, draft.torch_dtype,
                                                    attention_backend(device), quant=fp8)
        load_stage_weights(model, *draft.checkpoint_on_this_node(), quant=draft.quant_config)
        model.eval()
        out = cls(model, draft.model, config.cache.kv_torch_dtype(draft.torch_dtype), {})
        out.report = {"path": draft.model, "layers": draft.num_layers,
                      "weight_bytes": sum(p.numel() * p.element_size()
                                          for p in model.parameters()),
                      "block_bytes": out.kv_block_bytes(config.cache.block_size)}
        return out

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one cache block of the draft (all its layers) takes on this worker."""
        kv_heads, head_dim = self.model.kv_cache_layout()
        return (2 * block_size * kv_heads * head_dim * self.model.num_layers
                * self.kv_dtype.itemsize)

    def runner(self, num_blocks: int, block_size: int, device: torch.device,
               on_progress: Callable[[], None] | None = None) -> DraftRunner:
        """A :class:`DraftRunner` over a fresh cache of ``num_blocks`` blocks (the target's
        count: the block tables index both); ``on_progress``: the stage's progress tick,
        called as the draft's forwards advance as the target's does."""
        kv_heads, head_dim = self.model.kv_cache_layout()
        caches = [zeros((2, num_blocks, block_size, kv_heads, head_dim), self.kv_dtype, device)
                  for _ in range(self.model.num_layers)]
        return DraftRunner(self.model, caches, device, block_size, on_progress)


class DraftRunner:
    """Runs the draft model over the first stage's steps (module docstring)."""

    def __init__(self, model: StageModel, kv_caches: list[torch.Tensor], device: torch.device,
                 block_size: int, on_progress: Callable[[], None] | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.on_progress = on_progress  # the stage's progress tick (raypp.worker.progress)
        self.graphs: Any = None  # its DecodeGraphs on CUDA (set by the worker), else None

    def run(self, step: ResolvedStep) -> list[int] | None:
        """Feed ``step``'s rows to the draft (after their catch-up tokens) and, for a
        ``VERIFY`` step, draft each drafting row's ``draft_lens[r]`` tokens greedily.

        Returns a ``VERIFY`` step's drafts, per sampled row in order, flat (what
        :func:`with_drafts` writes into the step); ``None`` for any other step.
        """
        n, qs = step.num_seqs, step.query_start
        lens = [0] * n  # tokens each row drafts
        row_of = {qs[r + 1] - 1: r for r in range(n)}  # a row's last token index -> the row
        if step.mode is StepMode.VERIFY:
            for last, d in zip(step.sample_rows, step.draft_lens, strict=True):
                lens[row_of[last]] = d
        catchup = step.draft_catchup or [[]] * n
        # pass 0: catch-up and real tokens of every row; logits at drafting rows' last
        ids, starts, ends = [], [0], []
        for r in range(n):
            ids.extend(catchup[r])
            ids.extend(step.input_ids[qs[r]:qs[r + 1] - lens[r]])
            starts.append(len(ids))
            ends.append(step.seq_lens[r] - lens[r])
        drafting = [r for r in range(n) if lens[r]]
        firsts = self._forward(step, list(range(n)), ids, starts, ends,
                               [starts[r + 1] - 1 for r in drafting])
        drafts = {r: [t] for r, t in zip(drafting, firsts, strict=True)}
        for j in range(1, max(lens, default=0)):  # one token per row that drafts further
            rows = [r for r in drafting if lens[r] > j]
            nexts = self._forward(step, rows, [drafts[r][-1] for r in rows],
                                  list(range(len(rows) + 1)), [ends[r] + j for r in rows],
                                  list(range(len(rows))))
            for r, t in zip(rows, nexts, strict=True):
                drafts[r].append(t)
        if step.mode is not StepMode.VERIFY:
            return None
        return [t for last in step.sample_rows for t in drafts.get(row_of[last], [])]

    def _forward(self, step: ResolvedStep, rows: list[int], ids: list[int],
                 query_start: list[int], seq_lens: list[int], picks: list[int]) -> list[int]:
        """One draft forward over ``ids`` (rows ``rows`` of ``step``, each ending at its
        ``seq_lens`` entry); the argmax token at each flat index in ``picks``."""
        lean = StepInput(step.step_id, ids, query_start, seq_lens,
                         [step.seq_ids[r] for r in rows], [], None)
        resolved = ResolvedStep.of(lean, [step.block_tables[r] for r in rows], self.block_size)
        dev = self.device
        if self.graphs is not None and self.graphs.can_run(resolved):  # one token per row
            if not picks:
                self.graphs.run(resolved, None)  # writes the rows' KV; no token wanted
                return []
            logits = self.graphs.run(resolved, None)  # [rows, vocab], valid until next replay
            index = torch.tensor(picks, dtype=torch.int64, device=dev)
            return logits.index_select(0, index).argmax(-1).tolist()
        positions = torch.tensor(resolved.positions, dtype=torch.int64, device=dev)
        meta = attention_metadata(resolved, dev, self.on_progress)
        hidden, _ = self.model(positions, meta, self.kv_caches,
                               input_ids=torch.tensor(ids, dtype=torch.int64, device=dev))
        if not picks:
            return []
        index = torch.tensor(picks, dtype=torch.int64, device=dev)
        # hidden: [tokens, hidden] -> logits: [len(picks), vocab]
        return self.model.compute_logits(hidden.index_select(0, index)).argmax(-1).tolist()


def with_drafts(step: StepInput, drafts: list[int]) -> list[int]:
    """``step``'s input ids with its drafting rows' placeholders replaced by ``drafts``
    (per sampled row in order, ``draft_lens[r]`` each, flat); a new list."""
    ids, i = list(step.input_ids), 0
    for last, d in zip(step.sample_rows, step.draft_lens, strict=True):
        ids[last - d + 1:last + 1] = drafts[i:i + d]
        i += d
    if i != len(drafts):
        raise ValueError(f"step {step.step_id}: {len(drafts)} drafted tokens for "
                         f"{i} drafted positions")
    return ids
