"""Structured outputs on the driver: grammars compiled and cached, one matcher per
constrained sequence, and the token bitmask each of its steps carries to the sampler.

The grammar library is xgrammar. What callers may rely on:

- :meth:`StructuredOutputs.submit` compiles a :class:`~raypp.sampling_params.
  StructuredOutputsParams` on this object's own thread, never on the caller's, and
  caches the result per spec (``spec.key()``, least recently used dropped past
  ``cache_size``): a second request with the same schema waits for nothing. A spec the
  library rejects fails its future with :class:`GrammarError` (a ``ValueError``)
  carrying the library's message; it is cached too, so it fails fast again.
- A sequence's :class:`SeqGrammar` has accepted exactly its output tokens so far:
  the output processor advances it with every token it appends
  (:func:`advance`), and nothing else does. Preemption by recompute, prefix caching
  and stage recovery change only the KV cache, never the output tokens, so the
  matcher stays right through all three; a step's tokens that never arrive (a failed
  step) are never appended, so never accepted.
- :func:`token_bitmasks` is the mask of the next token for each row of a step being
  built: it refuses (``RuntimeError``) a sequence whose matcher is not at its output's
  end, which the scheduler guarantees by never running a constrained row ahead
  (:meth:`raypp.engine.rounds.RoundPolicy.loops_on_device`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypp.engine.sequence import Sequence
    from raypp.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] [^\s:]+:\d+: ")  # "[09:07:12] /x/y.cc:94: "


class GrammarError(ValueError):
    """The grammar library rejected a structured-outputs spec; the message is its own."""


class StructuredOutputs:
    """Grammar compilation and matchers for one engine (thread-safe).

    ``vocab_size`` is the model's logits width (masks cover it: ids the tokenizer lacks
    are never allowed); ``stop_token_ids`` end a complete grammar (the engine's EOS ids).
    The tokenizer's vocabulary is indexed on the compile thread the first time a
    grammar is needed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on the compile thread
        self._buffer: Any = None  # numpy int32 [rows, words]: the step builder's scratch

    # -- compiling (any thread) ----------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a future (module docstring)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="raypp-grammar")
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """:meth:`submit` and wait; raises :class:`GrammarError`."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - the library's rejection, reported as such
            message = _LIBRARY_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__
            raise GrammarError(f"invalid structured output ({kind}): {message}") from None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ImportError("structured outputs need xgrammar: pip install "
                                  "'raypp[structured]'") from None

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def grammar(self, compiled: Any) -> SeqGrammar:
        """A fresh matcher (nothing accepted) of a compiled grammar, for one sequence."""
        import xgrammar

        return SeqGrammar(self, xgrammar.GrammarMatcher(compiled))

    # -- masks (the engine's thread) ------------------------------------------------------
    def bitmasks(self, grammars: list[SeqGrammar]) -> list[bytes]:
        """The packed next-token bitmask of each grammar (``SamplingBatch.token_bitmask``).

        One fill per row into a reused buffer. xgrammar's threaded batch fill measured the
        same on the 2-core VM and 8x slower on the 16-core GPU host (64 rows of a 128k
        vocabulary: 3.5 ms against 0.43 ms, its threads' hand-offs cost more than the
        fills; ``benchmarks/gpu/README.md``, run 17)."""
        import numpy as np

        words = (self.vocab_size + 31) // 32
        if self._buffer is None or self._buffer.shape[0] < len(grammars):
            self._buffer = np.zeros((max(64, len(grammars)), words), dtype=np.int32)
        buffer = self._buffer[:len(grammars)]
        for row, grammar in enumerate(grammars):
            grammar.matcher.fill_next_token_bitmask(buffer, row)
        return [row.tobytes() for row in buffer]

    def close(self) -> None:
        """Stop the compile thread (a compile in progress finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class SeqGrammar:
    """One sequence's matcher: the grammar state after its output tokens so far."""

    __slots__ = ("owner", "matcher", "num_accepted")

    def __init__(self, owner: StructuredOutputs, matcher: Any):
        self.owner = owner
        self.matcher = matcher
        self.num_accepted = 0  # output tokens accepted: always the sequence's output length

    def accept(self, tokens: list[int]) -> bool:
        """Accept ``tokens`` in order; False at the first the grammar refuses (the rest
        are not accepted)."""
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


def advance(seq: Sequence, tokens: list[int]) -> bool:
    """Accept ``seq``'s newly appended ``tokens`` into its grammar; True if the sequence
    must stop here: its grammar ended, or refused a token (an engine bug, logged)."""
    grammar = seq.grammar
    before = grammar.num_accepted
    if not grammar.accept(tokens):
        logger.error("sequence %d: its grammar refuses token %d after %d tokens; stopping it",
                     seq.seq_id, tokens[grammar.num_accepted - before], grammar.num_accepted)
        return True
    return grammar.terminated


def token_bitmasks(seqs: list[Sequence]) -> list[bytes | None]:
    """Per row of a step, its sequence's next-token bitmask (``None``: unconstrained);
    ``[]`` when no row is constrained (module docstring)."""
    constrained = [(r, seq.grammar) for r, seq in enumerate(seqs) if seq.grammar is not None]
    if not constrained:
        return []
    for r, grammar in constrained:
        seq = seqs[r]
        if grammar.num_accepted != len(seq.output_token_ids):
            raise RuntimeError(f"sequence {seq.seq_id}: its grammar accepted {grammar.num_accepted} "
                               f"tokens but it has {len(seq.output_token_ids)}: a constrained "
                               "row ran ahead of its grammar")
    masks = constrained[0][1].owner.bitmasks([g for _, g in constrained])
    out: list[bytes | None] = [None] * len(seqs)
    for (r, _), mask in zip(constrained, masks):
        out[r] = mask
    return out
