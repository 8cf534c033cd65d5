"""ModelConfig: which checkpoint to run and how (dtype, length, seed, sampling defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from raypp.model.quantization.config import QuantConfig, UnsupportedQuantizationError
from raypp.model.quantization.resolve import resolve_quant_config

if TYPE_CHECKING:
    from raypp.model.gguf_cache import GGUFMetadata
    from raypp.model_source import HubModel

DEFAULT_CACHE_DIR = "~/.cache/raypp"

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
    ``model`` is a model name (:func:`raypp.model_source.resolve_model`: a path,
    ``"demo"``, or a Hugging Face Hub id, fetched at ``revision``: a branch, tag or commit,
    default ``main``; ``revision`` with any other name is a ``ValueError``).

    ``cache_dir`` is where raypp keeps what it fetches and derives (the demo model, a GGUF
    file's config, tokenizer and tensor table: :mod:`raypp.model.gguf_cache`);
    :meth:`raypp.config.EngineConfig.from_kwargs` fills it from ``RAYPP_CACHE_DIR``, else
    :data:`DEFAULT_CACHE_DIR`, the default here too.

    ``max_model_len`` left ``None`` is the checkpoint's ``max_position_embeddings``, and
    ``max_model_len_given`` False: the engine may then lower it to what its KV cache holds
    (:meth:`fit_max_model_len`). ``generation_config``: ``"auto"`` takes the sampling
    defaults (:attr:`sampling_defaults`) from the checkpoint's ``generation_config.json``
    (for a GGUF file: one beside it), ``"none"`` ignores it, a directory reads its
    ``generation_config.json``.

    ``quantization``: ``None`` loads the checkpoint as it is (an FP8 checkpoint's own
    format, :mod:`raypp.model.quantization`); ``"fp8"`` also quantizes a 16/32-bit
    checkpoint's linear weights to FP8 as they load. ``quant_config`` is the resolved
    format (``None``: no FP8); a format raypp does not read is
    :class:`~raypp.model.quantization.config.UnsupportedQuantizationError` naming it.

    After construction ``model`` is the resolved directory, or the ``.gguf`` file (its
    directory resolved, its name kept: in a Hub snapshot it is a link to a blob),
    ``hub`` where a Hub id came from (:class:`~raypp.model_source.HubModel`: repo, the
    commit resolved, GGUF file; ``None`` for a local path), ``tokenizer`` where
    transformers loads the tokenizer from, and ``architecture`` the supported
    architecture the config names (a config without ``architectures`` falls back to its
    ``model_type``, as transformers does). Raises ``FileNotFoundError``
    (:class:`~raypp.model_source.ModelNotFoundError`) naming the path when it, or its
    ``config.json``, is missing or when it is a file other than a GGUF file, and naming
    what was tried for a Hub id that cannot be had; ``ValueError`` for an unsupported
    architecture (naming the supported ones), GGUF tensor type (naming it), dtype,
    ``max_model_len``, ``generation_config`` or ``revision``.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    generation_config: str = "auto"
    cache_dir: str | None = None
    revision: str | None = None
    quantization: str | None = None
    hub: HubModel | None = field(init=False, repr=False, default=None)
    hf_config: dict[str, Any] = field(init=False, repr=False)
    architecture: str = field(init=False)
    tokenizer: str = field(init=False, repr=False)
    max_model_len_given: bool = field(init=False, repr=False)
    gguf: GGUFMetadata | None = field(init=False, repr=False, default=None)
    sampling_defaults: dict[str, Any] = field(init=False, repr=False)
    quant_config: QuantConfig | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from raypp.model import gguf
        from raypp.model.registry import resolve_architecture
        from raypp.model_source import KINDS, ModelNotFoundError, resolve_model

        self.cache_dir = str(Path(self.cache_dir or DEFAULT_CACHE_DIR).expanduser())
        source = resolve_model(self.model, self.cache_dir, revision=self.revision)
        path, self.hub = source.path, source.hub
        gguf_file = gguf.find_gguf(path)
        if gguf_file is not None:
            self.model = str(gguf_file.parent.resolve() / gguf_file.name)
            self.gguf = gguf.metadata(self.model, self.cache_dir)
            self.hf_config = self.gguf.config
            self.tokenizer = self.gguf.tokenizer_dir or self.model
        else:
            if path.is_file():
                raise ModelNotFoundError(f"model {self.model!r} is a file but not a GGUF file "
                                         f"(.gguf); a model is {KINDS}")
            config_file = path / "config.json"
            if not config_file.is_file():
                raise ModelNotFoundError(f"{str(config_file)!r} not found: {self.model!r} is not "
                                         "a Hugging Face model directory (nor a directory "
                                         f"holding one .gguf file); a model is {KINDS}")
            self.model = str(path.resolve())
            self.tokenizer = self.model
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
        self.max_model_len_given = self.max_model_len is not None
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not (isinstance(self.max_model_len, int) and 0 < self.max_model_len <= limit):
            raise ValueError(
                f"max_model_len must be an integer in [1, {limit}] (the checkpoint's "
                f"max_position_embeddings), got {self.max_model_len!r}"
            )
        self.sampling_defaults = self._read_sampling_defaults()

    def checkpoint_on_this_node(self) -> tuple[str, GGUFMetadata | None]:
        """The checkpoint path a stage loads this model from on this node, and its GGUF
        tensor table: the driver's, or on a node without the driver's path, the Hub model
        fetched into this node's own cache at the driver's commit
        (:func:`raypp.model_source.stage_checkpoint`; a local path missing here is a
        ``ModelNotFoundError`` saying what to do)."""
        import dataclasses

        from raypp.model_source import stage_checkpoint

        path = stage_checkpoint(self.model, self.hub)
        if path == self.model or self.gguf is None:
            return path, self.gguf
        return path, dataclasses.replace(self.gguf, path=str(Path(path).resolve()))

    def fit_max_model_len(self, tokens: int) -> bool:
        """Lower ``max_model_len`` to ``tokens`` (what the KV cache holds) if the user gave
        none; False (nothing changed) when they gave one or it already fits."""
        if self.max_model_len_given or self.max_model_len <= tokens:
            return False
        self.max_model_len = tokens
        return True

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

    def _generation_config_file(self) -> Path | None:
        """``generation_config.json`` as ``generation_config`` says, or ``None``."""
        choice = self.generation_config
        if choice == "none":
            return None
        if choice == "auto":
            folder = Path(self.model).parent if self.is_gguf else Path(self.model)
        else:
            folder = Path(choice).expanduser()
            if not folder.is_dir():
                raise ValueError("generation_config must be 'auto', 'none' or a directory "
                                 f"holding generation_config.json, got {choice!r}")
        file = folder / "generation_config.json"
        return file if file.is_file() else None

    def _read_sampling_defaults(self) -> dict[str, Any]:
        file = self._generation_config_file()
        if file is None:
            return {}
        try:
            gen = json.loads(file.read_text())
        except ValueError as e:
            raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from None
        return {key: gen[key] for key in _SAMPLING_KEYS if gen.get(key) is not None}

    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json, else config.json (a GGUF file: its metadata)."""
        gen = Path(self.model) / "generation_config.json"
        source = json.loads(gen.read_text()) if not self.is_gguf and gen.is_file() else {}
        eos = source.get("eos_token_id", self.hf_config.get("eos_token_id"))
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [int(eos)]


# The SamplingParams fields a generation_config.json may set, as vLLM takes them (its
# do_sample is ignored there too). max_new_tokens is not taken: a
# request's default length stays its API's (16 for SamplingParams and completions, the
# context's end for chat), which the context bounds.
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
