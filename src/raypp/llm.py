"""The offline API: ``LLM(model, pipeline_parallel_size=…).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from raypp.config import EngineConfig
from raypp.engine.engine import LLMEngine
from raypp.errors import ErrorKind, RequestFailedError
from raypp.outputs import RequestOutput
from raypp.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """A pipeline-parallel model on Ray, for offline batched generation.

    ``model`` is a model name: a Hugging Face–format directory, a ``.gguf`` file,
    ``"demo"`` (SmolLM2-135M-Instruct, fetched once), or a Hugging Face Hub id
    (``"org/name"``, ``"org/name/FILE.gguf"``; ``revision=`` picks a branch, tag or commit),
    fetched into the Hub cache (:mod:`raypp.model_source`).
    Starts a local Ray cluster (or joins ``ray_address`` / ``RAY_ADDRESS``).
    Extra keyword arguments are fields of the engine's configs, mapped by
    :meth:`raypp.config.EngineConfig.from_kwargs` as the command line's options and
    ``AsyncLLMEngine.from_model``'s are: the KV cache (``block_size``,
    ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``enable_prefix_caching``),
    the scheduler (``max_num_seqs``, ``max_num_batched_tokens``, ``max_inflight``,
    ``num_decode_steps``, ``async_scheduling``, ``pipelined_prefill``,
    ``long_prefill_chunk_tokens``, ``balanced_prefill_chunks``), FP8 (``quantization="fp8"``:
    quantize a 16/32-bit checkpoint as it loads, FP8 checkpoints are read in their own format;
    ``kv_cache_dtype="fp8"``), parallelism (``layer_partition``,
    ``use_ray_wrapped_pp_comm``, ``placement_strategy``, ``cpu_p2p``) and the runtime
    (``step_timeout_s``, ``enforce_eager``, ``restart_window_s``, …); an option left
    out takes its ``RAYPP_*`` default, and an unknown one raises
    :class:`~raypp.config.UnknownOptionError` (a ``ValueError`` and a ``TypeError``)
    naming it and its close matches. Use as a context manager or call :meth:`shutdown`.
    """

    def __init__(
        self,
        model: str,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        ray_address: str | None = None,
        device: str = "auto",
        control_plane: str | None = None,
        max_restarts: int | None = None,
        **kwargs: Any,
    ):
        config = EngineConfig.from_kwargs(
            model, pipeline_parallel_size=pipeline_parallel_size,
            tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            max_model_len=max_model_len, ray_address=ray_address, device=device,
            control_plane=control_plane, max_restarts=max_restarts, **kwargs)
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` on an engine config built beforehand (e.g. by
        :meth:`EngineConfig.from_kwargs <raypp.config.EngineConfig.from_kwargs>`, to check
        requests before anything starts)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.engine.emit_unfinished = False  # generate() only needs final outputs
        self._request_ids = itertools.count()

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``sampling_params`` left ``None`` is :meth:`get_default_sampling_params` (the
        model's generation-config defaults); a ``SamplingParams`` given is used as it is.
        All prompts and parameters are validated before any runs, grammars
        (``SamplingParams.structured_outputs``) compiled: an invalid one raises
        ``ValueError`` and nothing is queued; a prompt whose ``max_tokens`` exceeds what
        ``max_model_len`` leaves raises :class:`~raypp.errors.ContextLengthError` (a
        ``ValueError``) naming both numbers. ``max_tokens=None`` generates until a stop
        or the context's end.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        engine = self.engine
        prepared = [engine.prepare_prompt(p) for p in prompts]
        for (_, token_ids), p in zip(prepared, params):
            engine.validate_prompt(token_ids, p)
        for p in {id(p): p for p in params}.values():
            engine.validate_params(p)
            if p.structured_outputs is not None:
                engine.structured.compile(p.structured_outputs)
        ids = [f"gen-{next(self._request_ids)}" for _ in prompts]
        for request_id, (text, token_ids), p in zip(ids, prepared, params):
            engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, p)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render conversations with the tokenizer's chat template, then :meth:`generate`:
        one :class:`RequestOutput` per conversation (``messages`` may be one conversation,
        a list of ``{"role", "content"}`` dicts, or a list of them)."""
        from raypp.engine.tokenizer import render_chat

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [render_chat(self.engine.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request finished. A failed request (a stage exception, a
        poison request) fails alone, raised at the end; a stopped engine raises at once."""
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while len(finished) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
                        if out.error and out.error_kind is ErrorKind.ENGINE_DEAD:
                            raise self._failure(request_ids, finished)
        except BaseException:
            for request_id in wanted - set(finished):
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        if any(out.error for out in finished.values()):
            raise self._failure(request_ids, finished)
        return [finished[i] for i in request_ids]

    @staticmethod
    def _failure(request_ids: list[str], finished: dict[str, RequestOutput]) -> RequestFailedError:
        outputs = [finished.get(i) for i in request_ids]
        errors = {k: o.error for k, o in enumerate(outputs) if o is not None and o.error}
        return RequestFailedError(errors, outputs)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's sampling defaults: those its
        ``generation_config.json`` sets (``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``; ``generation_config="none"`` ignores it), the rest
        ``SamplingParams``' own."""
        return SamplingParams(**self.engine.config.model.sampling_defaults)

    # -- lifecycle ---------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def is_healthy(self) -> bool:
        return self.engine.is_healthy()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while requests run."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Tear down the compiled graph and the stage actors (idempotent)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | SequenceABC[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
