"""GGUF checkpoints, read through transformers' own GGUF support and the ``gguf`` package.

A checkpoint is a ``.gguf`` file, or a directory holding exactly one (and no
``config.json``). transformers turns its metadata into a Hugging Face config and its
tokenizer fields into a tokenizer; it also names each GGUF tensor's Hugging Face
parameter and undoes llama.cpp's conversions (Llama's q/k row permutation, Gemma's
``1 + w`` norms). :func:`metadata` derives all of that once per file
(:class:`~raypp.model.gguf_cache.GGUFMetadata`, kept in raypp's cache by
:mod:`raypp.model.gguf_cache`); :func:`load_gguf_weights` then reads and dequantizes only
the tensors of its stage's layers (the file is memory-mapped), in fp32, and its
parameters round them to the requested dtype. A tensor type the ``gguf`` package cannot
dequantize is refused up front, by name.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from pathlib import Path
from typing import Any

import torch

from raypp.model import gguf_cache
from raypp.model.base import LoadReport, StageModel
from raypp.model.gguf_cache import GGUFMetadata, GGUFTensor


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself if it is a ``.gguf`` file, the one ``.gguf`` in a
    directory without ``config.json``; ``None`` for anything else. ``ValueError`` for a
    directory holding several."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{str(path)!r} holds several GGUF files ({', '.join(f.name for f in found)}); "
                         "give the path of one")
    return found[0] if found else None


def metadata(path: str, cache_dir: str | Path | None) -> GGUFMetadata:
    """The file's :class:`GGUFMetadata`: from ``cache_dir`` when stored there, else derived
    through transformers (slow: every metadata field is parsed in Python; once per process)
    and stored there (``cache_dir=None``: not stored). ``ValueError`` for a file
    transformers cannot read, whose architecture it does not convert, or with a tensor
    type ``gguf`` cannot dequantize."""
    file = Path(path).resolve()
    if cache_dir is not None:
        stored = gguf_cache.load(str(file), cache_dir)
        if stored is not None:
            return stored
    stat = file.stat()
    meta, tokenizer = _derive(str(file), stat.st_mtime_ns, stat.st_size)
    if cache_dir is not None:
        meta = gguf_cache.store(meta, tokenizer, cache_dir) or meta
    return copy.deepcopy(meta)


@functools.lru_cache(maxsize=4)
def _derive(path: str, mtime_ns: int, size: int) -> tuple[GGUFMetadata, Any]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    reader = _reader(path)
    check_tensor_types(reader)
    file = Path(path)
    try:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name).to_dict()
    except (ValueError, KeyError, NotImplementedError) as e:
        from raypp.model.registry import SUPPORTED_ARCHITECTURES

        raise ValueError(f"GGUF file {path!r}: transformers cannot read it ({e}); raypp supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}") from e
    if not config.get("architectures"):  # as a Hugging Face checkpoint's config.json names it
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        config["architectures"] = [name] if name else None
    config = json.loads(json.dumps(config))  # as the cache gives it back (JSON: string keys)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"GGUF file {path!r}: cannot load its tokenizer: {e}") from e
    arch = str(read_field(reader, "general.architecture")[0])
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    tensors = [GGUFTensor(t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes),
                          t.data.dtype.str, tuple(int(d) for d in t.data.shape))
               for t in reader.tensors]
    try:
        hf_names = _hf_names(config, arch, processor)
    except (ValueError, KeyError) as e:  # e.g. a config transformers cannot build a model from
        from raypp.model.registry import SUPPORTED_ARCHITECTURES

        raise ValueError(f"GGUF file {path!r}: {e}; raypp supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}") from e
    return GGUFMetadata(path, arch, config, tensors, hf_names), tokenizer


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, KeyError) as e:  # e.g. a tensor type id this gguf version does not know
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e


def check_tensor_types(reader: Any) -> None:
    """``ValueError`` naming the first tensor whose type the ``gguf`` package cannot
    dequantize (tried on one row of one tensor of each type)."""
    import gguf

    tried = set()
    for tensor in reader.tensors:
        if tensor.tensor_type in tried:
            continue
        tried.add(tensor.tensor_type)
        sample = tensor.data[:1] if tensor.data.ndim > 1 else tensor.data
        try:
            gguf.dequantize(sample, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf "
                f"package ({_gguf_version()}) cannot dequantize; re-quantize the model to a "
                "supported type (e.g. F16, BF16, Q8_0, Q4_K)") from None


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gguf {version('gguf')}"
    except PackageNotFoundError:
        return "gguf"


def preload() -> threading.Thread:
    """Import what :func:`load_gguf_weights` needs (transformers' GGUF tensor processors,
    ~1 s) on a daemon thread, so a stage does it while it waits for its peers; a later
    import waits for this one (the import lock)."""

    def load() -> None:
        import gguf  # noqa: F401
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401

    thread = threading.Thread(target=load, name="raypp-gguf-preload", daemon=True)
    thread.start()
    return thread


def load_gguf_weights(model: StageModel, meta: GGUFMetadata) -> Any:
    """Fill ``model``'s parameters from the GGUF file ``meta`` describes, dequantizing only
    the tensors this stage owns (each TP rank dequantizes its stage's tensors and keeps its
    slice). Returns a :class:`raypp.model.base.LoadReport` (Hugging Face names, GGUF
    bytes read). ``ValueError`` naming any parameter the file does not provide."""
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(meta.architecture, TensorProcessor)(config=model.cfg)
    file = np.memmap(meta.path, dtype=np.uint8, mode="r")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    report = LoadReport()
    for tensor in meta.tensors:
        name = meta.hf_names.get(tensor.name)
        targets = model.checkpoint_names(name) if name else []
        if not targets:
            continue
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        weights = gguf.dequantize(tensor.data(file), qtype)
        weights = processor.process(weights=weights, name=tensor.name).weights
        # dequantize returns the read-only map for unquantized tensors: copy only those
        value = torch.from_numpy(weights if weights.flags.writeable else np.copy(weights))
        for target, shard in targets:
            param = params[target]
            with torch.no_grad():
                param.weight_loader(param, value, shard)
            loaded.add(target)
        report.names.append(name)
        report.bytes_read += tensor.n_bytes
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"GGUF file {meta.path!r} lacks weights for: {', '.join(missing[:8])}")
    return report


def _hf_names(cfg: dict[str, Any], arch: str, processor: Any) -> dict[str, str]:
    """GGUF tensor name → Hugging Face parameter name, as transformers'
    ``get_gguf_hf_weights_map`` maps them: each parameter of the transformers model this
    config builds (on the meta device) through the ``gguf`` package's tensor-name map of
    the file's architecture. (Only the model's own names: transformers' function also
    walks every submodule, which a plain decoder does not need and which takes seconds.)"""
    import gguf
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise ValueError(f"the gguf package ({_gguf_version()}) does not know GGUF architecture "
                         f"{arch!r}")
    name_map = gguf.get_tensor_name_map(arch_id, int(cfg["num_hidden_layers"]))
    out = {}
    for hf_name in hf_model.state_dict():
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = f"{base}{dot}{suffix}", "", ""
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            out[f"{gguf_name}{dot}{suffix}"] = hf_name
    return out
