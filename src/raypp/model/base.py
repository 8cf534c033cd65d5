"""What every model family's stage model provides, so the worker, the loader and the
CUDA graphs treat families alike (a new family is its own module plus a line in
:mod:`raypp.model.registry`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


def layer_window(sliding_window: int | None, layer_types: list[str], index: int) -> int | None:
    """The sliding window of global layer ``index``: ``sliding_window`` where its type is
    ``"sliding_attention"`` (transformers' ``layer_types``), else ``None`` (full attention)."""
    return sliding_window if layer_types[index] == "sliding_attention" else None


@dataclass
class LoadReport:
    """What loading a stage's weights read (:func:`raypp.model.loader.load_stage_weights`,
    :func:`raypp.model.gguf.load_gguf_weights`)."""

    names: list[str] = field(default_factory=list)  # checkpoint tensors touched
    bytes_read: int = 0


@dataclass(frozen=True)
class StageSpec:
    """Which global layers ``[start, end)`` a stage owns, and its ends."""

    start: int
    end: int
    is_first: bool
    is_last: bool


class StageModel(nn.Module):
    """One pipeline stage of a decoder-only model: only its layers exist.

    A family subclass builds ``self.model.layers`` (a ``ModuleDict`` keyed by the
    global layer index, each with a ``self_attn`` exposing ``num_kv_heads`` and
    ``head_dim``), the embedding on the first stage and the final norm and LM head on
    the last, and implements:

    - ``forward(positions, meta, kv_caches, input_ids=None, hidden_states=None,
      residual=None) -> (hidden, residual or None)``: token ids on the first stage,
      the previous stage's pair otherwise; the last stage returns final normalized
      hidden states and ``None``;
    - :meth:`compute_logits` and :meth:`checkpoint_names` (the default maps the Hugging
      Face decoder layout, configured by :attr:`stacked_params` and :attr:`renamed_params`);
    - optionally a fused decode chain for CUDA graphs of small decode batches
      (:meth:`fused_decode_unsupported` returning ``None``, and
      ``fused_decode_forward``, whose arguments are those of
      :func:`raypp.worker.cuda_graphs.decode_forward` after the model);
    - :meth:`decode_graphs_unsupported` where its forward cannot be captured in a CUDA
      graph on its device (the worker then runs the stage eagerly).
    """

    stage: StageSpec
    cfg: dict  # the checkpoint's config (config.json, or what a GGUF file's metadata gives)
    tie_word_embeddings: bool = False
    fused_decode_max_rows: int = 0  # the largest batch fused_decode_forward serves
    # checkpoint sub-name → (our fused parameter, shard id)
    stacked_params: dict[str, tuple[str, object]] = {}
    # checkpoint sub-name → ours, for parameters that live under another module here
    renamed_params: dict[str, str] = {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler upcasts where it needs to)."""
        return self.lm_head.logits(hidden)

    def checkpoint_names(self, name: str) -> list[tuple[str, object]]:
        """Map a checkpoint tensor name to ``(our param name, shard)`` pairs (empty: skip).

        The Hugging Face decoder layout: ``model.embed_tokens`` (first stage, and the LM
        head of the last when embeddings are tied), ``model.layers.<i>.…`` (the stage's
        layers only; :attr:`stacked_params` go into fused parameters,
        :attr:`renamed_params` under another module), ``model.norm`` and ``lm_head``
        (last stage). Anything else (e.g. rotary ``inv_freq`` buffers) is skipped.
        """
        if name == "lm_head.weight":
            return [("lm_head.weight", None)] if self.stage.is_last else []
        if name == "model.embed_tokens.weight":
            out = [(name, None)] if self.stage.is_first else []
            if self.stage.is_last and self.tie_word_embeddings:
                out.append(("lm_head.weight", None))
            return out
        if name.startswith("model.norm."):
            return [(name, None)] if self.stage.is_last else []
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if not self.stage.start <= layer < self.stage.end:
                return []
            for sub, (fused, shard) in self.stacked_params.items():
                if f".{sub}." in name:
                    return [(name.replace(f".{sub}.", f".{fused}."), shard)]
            for sub, ours in self.renamed_params.items():
                if f".{sub}." in name:
                    return [(name.replace(f".{sub}.", f".{ours}."), None)]
            return [(name, None)]
        return []

    def kv_cache_layout(self) -> tuple[int, int]:
        """``(kv heads on this worker, head_dim)`` of every layer of this stage."""
        attn = next(iter(self.model.layers.values())).self_attn
        return attn.num_kv_heads, attn.head_dim

    @property
    def num_layers(self) -> int:
        return self.stage.end - self.stage.start

    def fused_decode_unsupported(self) -> str | None:
        """Why this stage has no fused decode chain (``None``: it has one)."""
        return f"{type(self).__name__} declares no fused decode chain"

    def decode_graphs_unsupported(self) -> str | None:
        """Why this stage's decode forward cannot be captured in a CUDA graph (``None``: it
        can; the default, as the forward waits for the host nowhere)."""
        return None
