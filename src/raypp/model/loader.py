"""Load only this stage's (and this TP shard's) weights from safetensors files.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are supported. Files are memory-mapped and only the tensors this
stage owns are read; each parameter's ``weight_loader`` takes its TP slice.
A ``.gguf`` path goes to :func:`raypp.model.gguf.load_gguf_weights`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from raypp.model.base import LoadReport, StageModel

if TYPE_CHECKING:
    from raypp.model.gguf_cache import GGUFMetadata


def checkpoint_files(model_dir: str) -> dict[str, list[str]]:
    """File → tensor names in it, for every safetensors file of the checkpoint."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(str(root / file), []).append(name)
        return files
    single = root / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {str(single): list(f.keys())}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}")


class LazySlice:
    """A checkpoint tensor not yet read: ``narrow`` reads only the rows asked for.

    Counts the bytes it reads, so callers can prove a TP shard read only its slice.
    """

    def __init__(self, handle: Any):
        self._handle = handle
        self.shape = tuple(handle.get_shape())
        self.bytes_read = 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        tensor = self._handle[tuple(index)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def load_stage_weights(model: StageModel, model_dir: str,
                       gguf_meta: GGUFMetadata | None = None) -> LoadReport:
    """Fill ``model``'s parameters, reading only this stage's tensors and, of
    each, only this TP rank's slice. ``model_dir``: a Hugging Face directory, or a
    ``.gguf`` file (:class:`raypp.model_config.ModelConfig` resolves a GGUF directory to
    it, and derives ``gguf_meta``, which is read from the file when not given).

    Raises ``ValueError`` naming any parameter of the stage that the checkpoint
    does not provide.
    """
    if model_dir.endswith(".gguf"):
        from raypp.model.gguf import load_gguf_weights, metadata

        return load_gguf_weights(model, gguf_meta or metadata(model_dir, None))
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    report = LoadReport()
    for file, names in checkpoint_files(model_dir).items():
        wanted = [(n, model.checkpoint_names(n)) for n in names]
        wanted = [(n, targets) for n, targets in wanted if targets]
        if not wanted:
            continue
        with safe_open(file, framework="pt") as f:
            for name, targets in wanted:
                lazy = LazySlice(f.get_slice(name))
                for target, shard in targets:
                    param = params[target]
                    with torch.no_grad():
                        param.weight_loader(param, lazy, shard)
                    loaded.add(target)
                report.names.append(name)
                report.bytes_read += lazy.bytes_read
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {', '.join(missing[:8])}")
    return report
