"""SpeculativeConfig: whether and how the engine drafts tokens for the target to verify."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from raypp.model_config import ModelConfig

logger = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in the shape vLLM users pass it
    (``speculative_config={"method": "ngram", "num_speculative_tokens": 4}``).

    ``method``: ``"ngram"`` (prompt lookup: the driver proposes the tokens that followed
    the latest earlier occurrence of the sequence's last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens) or ``"draft_model"`` (a small model with the target's
    vocabulary, ``model``, proposes greedily; inferred when only ``model`` is given).
    ``num_speculative_tokens``: the most tokens drafted per sequence and step; with
    ``adaptive`` (default) each sequence's draft length follows its recent acceptance
    (:mod:`raypp.engine.speculative`). Invalid values raise ``ValueError`` naming the key.

    With ``"draft_model"``, :meth:`bind` (which :class:`~raypp.config.EngineConfig` calls)
    checks the draft against the target and sets :attr:`draft`, the draft's
    :class:`~raypp.model_config.ModelConfig` in the target's dtype.
    """

    num_speculative_tokens: int
    method: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True
    # the draft model's config, set by bind() (method "draft_model" only)
    draft: ModelConfig | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not (isinstance(k, int) and 1 <= k <= 32):
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, 32], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError("speculative_config needs integers 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {lo!r} and {hi!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft "
                             "model's path")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config 'model' is for method 'draft_model', not 'ngram'")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be True or False, "
                             f"got {self.adaptive!r}")

    def bind(self, target: ModelConfig) -> None:
        """Check the draft model against ``target`` and load its config into
        :attr:`draft` (method ``"draft_model"``; nothing otherwise).

        Raises ``FileNotFoundError`` naming ``model`` when it is not a checkpoint, and
        ``ValueError`` when its vocabulary size differs from the target's (naming both)
        or its positions end before a ``max_model_len`` the user gave. With none given,
        the target's ``max_model_len`` is lowered to the draft's positions (one WARNING
        naming both numbers).
        """
        if self.method != "draft_model":
            return
        assert self.model is not None
        dtype = str(target.torch_dtype).removeprefix("torch.")  # the target's, as a name
        try:
            # resolved like the target's name (a path, "demo" or a Hub id, in its cache dir)
            draft = ModelConfig(self.model, dtype=dtype, cache_dir=target.cache_dir)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"speculative_config model (the draft): {e}") from None
        except ValueError as e:
            raise ValueError(f"speculative_config model (the draft): {e}") from None
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config model {self.model!r} has vocab_size "
                             f"{draft.vocab_size}, the target {target.model!r} has "
                             f"{target.vocab_size}: a draft must share the target's vocabulary")
        positions = draft.max_position_embeddings
        if positions < target.max_model_len and target.fit_max_model_len(positions):
            logger.warning("max_model_len lowered from the target's %d to %d: the draft %r "
                           "has %d positions (pass max_model_len to choose, or a draft with "
                           "more positions)", target.max_position_embeddings, positions,
                           self.model, positions)
        if positions < target.max_model_len:
            raise ValueError(f"speculative_config model {self.model!r} has "
                             f"max_position_embeddings {draft.max_position_embeddings}, fewer "
                             f"than the target's max_model_len {target.max_model_len}: lower "
                             "max_model_len")
        self.draft = draft

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """``value`` as a config: a dict's keys are checked (an unknown one is a
        ``ValueError`` naming it and the known ones)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(**value)
