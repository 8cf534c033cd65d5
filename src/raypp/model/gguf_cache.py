"""What raypp derives from a GGUF file's header, and where it keeps it between runs.

Deriving a GGUF's Hugging Face config and tokenizer through transformers parses every
metadata field in Python (for SmolLM2's 49k-token vocabulary: seconds, on every start),
and each stage parsed the header again to find its tensors. So the first start derives
a :class:`GGUFMetadata` once (:func:`raypp.model.gguf.metadata`) and stores it under
``<cache_dir>/gguf/<key>/``: ``metadata.json`` (the config, the tensor table, the GGUF ->
Hugging Face name map) and ``tokenizer/`` (transformers' ``save_pretrained``). Later
starts read those instead; stages get the tensor table inside the engine's config and
never parse the header.

What callers may rely on: the key (:func:`entry_dir`) hashes the file's resolved path,
size and modification time, this format's version and the versions of ``transformers``
and ``gguf`` that derived it, so a changed file or a new converter derives again. An
entry appears whole or not at all (written to a temporary directory, then renamed);
:func:`load` returns ``None`` for a missing or unreadable entry; a cache that cannot be
written costs only the speed (:func:`store` returns ``None``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1  # bump when what is stored changes


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: where its bytes are and how GGUFReader would view them."""

    name: str
    tensor_type: int  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int
    dtype: str  # numpy dtype of the stored items (uint8 for quantized blocks)
    shape: tuple[int, ...]  # numpy shape of the stored items

    def data(self, file: np.memmap) -> np.ndarray:
        """This tensor's stored items, a view into the memory-mapped ``file``."""
        raw = file[self.offset:self.offset + self.n_bytes]
        return raw.view(np.dtype(self.dtype)).reshape(self.shape)


@dataclass
class GGUFMetadata:
    """A GGUF file's header as raypp uses it; a plain value, sent to every stage."""

    path: str
    architecture: str  # general.architecture, e.g. "llama"
    config: dict[str, Any]  # the Hugging Face config transformers derives
    tensors: list[GGUFTensor]
    hf_names: dict[str, str]  # GGUF tensor name -> Hugging Face parameter name
    tokenizer_dir: str | None = None  # the tokenizer saved in the cache, if stored


def entry_dir(path: str, cache_dir: str | Path) -> Path:
    """``<cache_dir>/gguf/<key>``: the entry of the file at ``path`` as it is now."""
    file = Path(path).resolve()
    stat = file.stat()
    ident = json.dumps([str(file), stat.st_size, stat.st_mtime_ns, FORMAT,
                        _version("transformers"), _version("gguf")])
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / "gguf" / f"{file.stem[:40]}-{key}"


def load(path: str, cache_dir: str | Path) -> GGUFMetadata | None:
    """The stored metadata of the file at ``path``, or ``None``."""
    entry = entry_dir(path, cache_dir)
    try:
        stored = json.loads((entry / "metadata.json").read_text())
        tensors = [GGUFTensor(**{**t, "shape": tuple(t["shape"])}) for t in stored["tensors"]]
        return GGUFMetadata(path=str(Path(path).resolve()), architecture=stored["architecture"],
                            config=stored["config"], tensors=tensors, hf_names=stored["hf_names"],
                            tokenizer_dir=str(entry / "tokenizer"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(meta: GGUFMetadata, tokenizer: Any, cache_dir: str | Path) -> GGUFMetadata | None:
    """Write ``meta`` and ``tokenizer`` (saved with ``save_pretrained``) as the file's entry;
    returns ``meta`` pointing at the stored tokenizer, or ``None`` if nothing was written."""
    entry = entry_dir(meta.path, cache_dir)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".part-"))
    except OSError:
        return None
    try:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        stored = {"architecture": meta.architecture, "config": meta.config,
                  "tensors": [asdict(t) for t in meta.tensors], "hf_names": meta.hf_names}
        (tmp / "metadata.json").write_text(json.dumps(stored))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process stored it first: theirs is as good
            if not (entry / "metadata.json").is_file():
                raise
    except (OSError, TypeError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return GGUFMetadata(**{**asdict(meta), "tensors": meta.tensors,
                           "tokenizer_dir": str(entry / "tokenizer")})


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"
