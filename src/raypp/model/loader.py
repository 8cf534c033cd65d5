"""Load only this stage's (and this TP shard's) weights from safetensors files.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are supported. Files are memory-mapped and only the tensors this
stage owns are read; each parameter's ``weight_loader`` takes its TP slice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from raypp.model.llama import LlamaStageModel


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


def load_stage_weights(model: LlamaStageModel, model_dir: str) -> list[str]:
    """Fill ``model``'s parameters; returns the checkpoint names read.

    Raises ``ValueError`` naming any parameter of the stage that the checkpoint
    does not provide.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    read: list[str] = []
    for file, names in checkpoint_files(model_dir).items():
        wanted = [(n, model.checkpoint_names(n)) for n in names]
        wanted = [(n, targets) for n, targets in wanted if targets]
        if not wanted:
            continue
        with safe_open(file, framework="pt") as f:
            for name, targets in wanted:
                tensor = f.get_tensor(name)
                read.append(name)
                for target, shard in targets:
                    param = params[target]
                    with torch.no_grad():
                        param.weight_loader(param, tensor.to(param.dtype), shard)
                    loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {', '.join(missing[:8])}")
    return read
