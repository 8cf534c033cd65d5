"""ModelConfig: which checkpoint to run and how (dtype, length, seed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raypp.model.quantization.config import QuantConfig, UnsupportedQuantizationError
from raypp.model.quantization.resolve import resolve_quant_config

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class ModelConfig:
    """A checkpoint and how to run it: a Hugging Face–format directory (``config.json``,
    safetensors, tokenizer), or a GGUF file (or a directory holding one ``.gguf`` and no
    ``config.json``), whose config and tokenizer transformers reads from its metadata.

    After construction ``model`` is the resolved directory, or the resolved ``.gguf``
    file, and ``architecture`` the supported architecture the config names (a config
    without ``architectures`` falls back to its ``model_type``, as transformers does).
    Raises ``FileNotFoundError`` naming the path when it or its ``config.json`` is
    missing, ``ValueError`` for an unsupported architecture (naming the supported ones),
    GGUF tensor type (naming it), dtype or ``max_model_len``.

    ``quantization``: ``None`` loads the checkpoint as it is (an FP8 checkpoint's own
    format, :mod:`raypp.model.quantization`); ``"fp8"`` also quantizes a 16/32-bit
    checkpoint's linear weights to FP8 as they load. ``quant_config`` is the resolved
    format (``None``: no FP8); a format raypp does not read is
    :class:`~raypp.model.quantization.config.UnsupportedQuantizationError` naming it.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None
    hf_config: dict[str, Any] = field(init=False, repr=False)
    architecture: str = field(init=False)
    quant_config: QuantConfig | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from raypp.model import gguf
        from raypp.model.registry import resolve_architecture

        path = Path(self.model).expanduser()
        gguf_file = gguf.find_gguf(path)
        if gguf_file is not None:
            self.model = str(gguf_file.resolve())
            self.hf_config = gguf.read_config(self.model)
        else:
            if not path.is_dir():
                raise FileNotFoundError(
                    f"model directory {self.model!r} does not exist (raypp loads local "
                    "Hugging Face–format directories: config.json + *.safetensors + tokenizer, "
                    "or a .gguf file)"
                )
            config_file = path / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{str(config_file)!r} not found: not a Hugging Face "
                                        "model dir (nor a directory holding one .gguf file)")
            self.model = str(path.resolve())
            self.hf_config = json.loads(config_file.read_text())
        try:
            self.architecture = resolve_architecture(self.hf_config)
        except ValueError as e:
            raise ValueError(f"model {self.model!r}: {e}") from None
        if gguf_file is not None and self.quantization is not None:
            raise UnsupportedQuantizationError(
                f"quantization={self.quantization!r} applies to safetensors checkpoints; "
                f"{self.model!r} is GGUF, whose own tensor types are dequantized at load")
        self.quant_config = resolve_quant_config(self.hf_config, self.quantization)
        _ = self.torch_dtype  # validates dtype
        limit = self.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not (isinstance(self.max_model_len, int) and 0 < self.max_model_len <= limit):
            raise ValueError(
                f"max_model_len must be an integer in [1, {limit}] (the checkpoint's "
                f"max_position_embeddings), got {self.max_model_len!r}"
            )

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            name = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
            return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json, else config.json (a GGUF file: its metadata)."""
        gen = Path(self.model) / "generation_config.json"
        source = json.loads(gen.read_text()) if not self.is_gguf and gen.is_file() else {}
        eos = source.get("eos_token_id", self.hf_config.get("eos_token_id"))
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [int(eos)]
