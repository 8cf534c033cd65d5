"""Engine configuration: one dataclass per concern, each validating itself
(:class:`ModelConfig` lives in :mod:`raypp.model_config`), and
:meth:`EngineConfig.from_kwargs`, the one mapping of engine options onto them."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from raypp import envs
from raypp.fault_spec import FaultSpec
from raypp.model_config import DEFAULT_CACHE_DIR, ModelConfig
from raypp.speculative_config import SpeculativeConfig

_CONTROL_PLANES = ("cgraph", "direct")
_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ParallelConfig:
    """How many stages and TP ranks, where Ray runs, and how stages are connected.

    Fields left ``None`` take their ``RAYPP_*`` default (:mod:`raypp.envs`).
    ``layer_partition`` (layers per stage, a list or ``"3,2,2"``) overrides the
    split :meth:`EngineConfig.stage_layers` would choose (even, or by parameter bytes
    when layers differ in size); ``use_ray_wrapped_pp_comm=False`` makes the compiled graph carry PP
    tensors over Ray's own transport instead of :class:`RayPPCommunicator`;
    ``cpu_p2p`` picks the CPU groups' same-host transport (``"auto"`` or ``"gloo"``).
    ``workers_per_gpu`` (CUDA) lets that many workers share one GPU: each asks Ray for
    its fraction of a GPU and sizes its KV cache from its share of the memory, and
    edges between workers on one GPU are staged through host memory (every pp and
    tp × pp layout then runs on one GPU; see :mod:`raypp.distributed.communicator`).
    """

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    ray_address: str | None = None
    layer_partition: list[int] | str | None = None
    control_plane: str | None = None  # "cgraph" | "direct"
    use_ray_wrapped_pp_comm: bool | None = None
    placement_strategy: str | None = None
    cpu_p2p: str | None = None
    workers_per_gpu: int | None = None

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        plane = (self.control_plane or envs.RAYPP_CONTROL_PLANE or "cgraph").strip().lower()
        _check_choice("control_plane", plane, _CONTROL_PLANES)
        self.control_plane = plane
        if self.layer_partition is None:
            self.layer_partition = envs.RAYPP_PP_LAYER_PARTITION or None
        if isinstance(self.layer_partition, str):
            self.layer_partition = parse_partition(self.layer_partition)
        if self.use_ray_wrapped_pp_comm is None:
            self.use_ray_wrapped_pp_comm = envs.RAYPP_USE_RAY_WRAPPED_PP_COMM
        strategy = (self.placement_strategy or envs.RAYPP_PLACEMENT_STRATEGY).strip().upper()
        _check_choice("placement_strategy", strategy, _PLACEMENT_STRATEGIES)
        self.placement_strategy = strategy
        self.cpu_p2p = (self.cpu_p2p or envs.RAYPP_CPU_P2P).strip().lower()
        _check_choice("cpu_p2p", self.cpu_p2p, ("auto", "gloo"))
        if self.workers_per_gpu is None:
            self.workers_per_gpu = envs.RAYPP_WORKERS_PER_GPU
        if not (isinstance(self.workers_per_gpu, int) and self.workers_per_gpu >= 1):
            raise ValueError(f"workers_per_gpu must be an integer >= 1, got {self.workers_per_gpu!r}")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def gpus_per_worker(self) -> float:
        """The fraction of a GPU each worker asks Ray for (CUDA)."""
        return 1.0 / self.workers_per_gpu


@dataclass
class CacheConfig:
    """Paged KV cache sizing.

    On CUDA the cache takes ``gpu_memory_utilization`` of the device minus what is
    in use; on CPU it takes ``kv_cache_memory_bytes`` per stage, or left ``None`` a share
    of the host's available memory (:func:`raypp.worker.kv_memory.cpu_budget`).
    ``enable_prefix_caching`` (default on): full blocks of computed KV stay cached
    after their sequences end, and a prompt that starts with the same tokens reuses
    them instead of recomputing (:mod:`raypp.engine.block_manager`).
    ``kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"fp8"`` (alias ``"fp8_e4m3"``):
    keys and values stored in e4m3 with a per-layer scale (the checkpoint's
    ``k_scale``/``v_scale``, else 1.0), so a block takes one byte per element and the same
    memory holds ``dtype.itemsize`` times the tokens.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_memory_bytes is not None and not (
                isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0):
            raise ValueError(f"kv_cache_memory_bytes must be an integer > 0 or None, "
                             f"got {self.kv_cache_memory_bytes!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, "
                             f"got {self.enable_prefix_caching!r}")
        kv = str(self.kv_cache_dtype).strip().lower()
        _check_choice("kv_cache_dtype", kv, ("auto", "fp8", "fp8_e4m3"))
        self.kv_cache_dtype = "fp8" if kv.startswith("fp8") else kv

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache's element type: e4m3 for ``"fp8"``, else ``model_dtype``."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else model_dtype


@dataclass
class SchedulerConfig:
    """Batching limits; one left ``None`` is sized for the device by :meth:`size_for`
    (:data:`DEVICE_DEFAULTS`), which :class:`EngineConfig` calls.

    ``max_inflight``: micro-batches in the pipeline; default pp (pp + 1 measured
    slower on CPU: smaller micro-batches, the weights read once more per token).

    ``num_decode_steps`` > 1: a pure decode micro-batch may run up to that many steps
    in one round trip, the stage feeding each sampled token back as the next input on
    the device; only while no waiting request could join a batch (a prefill is never
    held back by more than the round in flight), with ``pipeline_parallel_size == 1``,
    and without penalties. Outputs equal single steps' (tokens past a stop are
    dropped); streamed tokens arrive in groups. Left ``None``: on CUDA the engine sizes
    each round, up to :data:`AUTO_DECODE_STEPS`, to about :data:`ROUND_TARGET_S` at the
    measured step time (a request arriving mid-round waits about two rounds at most);
    on CPU, where compute dwarfs the round trip, one step.

    ``async_scheduling`` (pp = 1): while a decode round runs, the engine already
    submits the batch's next round, whose input ids the stage takes on the device from
    the running round's last tokens, so the stage never waits for the engine's
    bookkeeping; only while no waiting request could join a batch; same outputs.

    ``pipelined_prefill`` (pp > 1): a long prompt's next chunk may enter the pipeline
    while its earlier chunks are still in it; default (``None``): on unless the stages
    share a GPU (``workers_per_gpu`` > 1), where they cannot compute at once and the
    smaller chunks only cost (measured: ``benchmarks/gpu/README.md``, run 14);
    ``long_prefill_chunk_tokens``: the most
    tokens of one prompt per step (default: the step budget, over the stages with
    pipelined prefill); ``balanced_prefill_chunks``: later chunks shrink as their context
    grows, for even stage times (:mod:`raypp.engine.chunking`). Decode rows are scheduled
    before prefill chunks; ``balanced_decode`` (default): at most
    ``ceil(decodes / max_inflight)`` per micro-batch, so the running decodes spread evenly
    over the micro-batches in flight (False: every ready decode row joins the next
    micro-batch, as long as the budget lasts).
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_inflight: int | None = None
    num_decode_steps: int | None = None
    async_scheduling: bool = True
    pipelined_prefill: bool | None = None
    long_prefill_chunk_tokens: int | None = None
    balanced_prefill_chunks: bool = True
    balanced_decode: bool = True
    # set by size_for: the engine sizes decode rounds itself (num_decode_steps left None)
    adaptive_rounds: bool = field(default=False, init=False)
    # set by size_for: a one-stage pipeline, whose stage can feed its sampled tokens back
    # (decode rounds, raypp.engine.rounds)
    device_loops: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_num_batched_tokens", "num_decode_steps",
                  "long_prefill_chunk_tokens"):
            value = getattr(self, f)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{f} must be an integer >= 1, got {value!r}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight!r}")
        for f in ("async_scheduling", "pipelined_prefill", "balanced_prefill_chunks",
                  "balanced_decode"):
            if not isinstance(getattr(self, f), bool) and not (
                    f == "pipelined_prefill" and self.pipelined_prefill is None):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")

    def size_for(self, device: str, pipeline_parallel_size: int = 1,
                 stages_share_device: bool = False) -> SchedulerConfig:
        """Give every limit left ``None`` its default for ``device`` ("cpu" or "cuda"),
        ``pipeline_parallel_size`` and whether stages share a GPU; returns ``self``.
        Idempotent."""
        self.device_loops = pipeline_parallel_size == 1
        if self.pipelined_prefill is None:
            self.pipelined_prefill = not stages_share_device
        if self.num_decode_steps is None:
            self.adaptive_rounds = device == "cuda" and self.device_loops
        for name, value in DEVICE_DEFAULTS[device].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.num_decode_steps is None:
            self.num_decode_steps = AUTO_DECODE_STEPS if self.adaptive_rounds else 1
        if self.max_inflight is None:
            self.max_inflight = pipeline_parallel_size
        return self

    @property
    def rounds_ahead(self) -> int:
        """Decode rounds submitted ahead of a running one: 1 with ``async_scheduling`` on
        a one-stage pipeline (whose stage holds the sampled tokens the next round feeds),
        else 0."""
        return int(self.async_scheduling and self.device_loops)


# Scheduler limits left unset, per device: on CUDA like the best peers' (many sequences,
# big prefill chunks: a GPU step costs little more for more rows); on CPU, where a step's
# cost grows with its tokens, smaller.
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
}
AUTO_DECODE_STEPS = 64  # the most decode steps of an engine-sized round (CUDA, pp = 1)
ROUND_TARGET_S = 0.02  # an engine-sized round lasts about this long


@dataclass
class RuntimeConfig:
    """Timeouts, recovery, the CUDA decode path and diagnostics.

    Every field left ``None`` takes its ``RAYPP_*`` default (:mod:`raypp.envs`
    documents each); this dataclass, not the environment, is what stage actors
    read. ``fault_inject`` is for tests only (grammar: :mod:`raypp.fault_spec`).
    """

    step_timeout_s: float | None = None
    dist_timeout_s: float | None = None
    max_restarts: int | None = None
    restart_window_s: float | None = None
    max_failures_per_request: int | None = None
    idle_suspend_s: float | None = None
    driver_wait: str | None = None  # "spin" | "poll" | "auto"
    cgraph_buffer_bytes: int | None = None
    enforce_eager: bool | None = None
    compile_decode: bool | None = None
    fused_decode_max_rows: int | None = None
    trace_comm: bool | None = None
    fault_inject: str | None = None
    cpu_threads: int | None = None  # 0: the host's cores over the stage workers
    stats_interval_s: float | None = None  # the engine's periodic log and occupancy window

    def __post_init__(self) -> None:
        defaults = {
            "step_timeout_s": envs.RAYPP_STEP_TIMEOUT_S,
            "dist_timeout_s": envs.RAYPP_DIST_TIMEOUT_S,
            "max_restarts": int(envs.RAYPP_MAX_RESTARTS),
            "restart_window_s": envs.RAYPP_RESTART_WINDOW_S,
            "max_failures_per_request": envs.RAYPP_MAX_FAILURES_PER_REQUEST,
            "idle_suspend_s": envs.RAYPP_IDLE_SUSPEND_S,
            "driver_wait": envs.RAYPP_DRIVER_WAIT,
            "cgraph_buffer_bytes": int(envs.RAYPP_CGRAPH_BUFFER_BYTES),
            "enforce_eager": envs.RAYPP_ENFORCE_EAGER,
            "compile_decode": envs.RAYPP_COMPILE_DECODE,
            "fused_decode_max_rows": envs.RAYPP_FUSED_DECODE,
            "trace_comm": envs.RAYPP_TRACE_COMM,
            "fault_inject": envs.RAYPP_FAULT_INJECT or None,
            "cpu_threads": envs.RAYPP_CPU_THREADS,
            "stats_interval_s": envs.RAYPP_STATS_INTERVAL_S,
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        for name in ("step_timeout_s", "dist_timeout_s", "restart_window_s", "stats_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_restarts", "idle_suspend_s", "fused_decode_max_rows", "cpu_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (isinstance(self.max_failures_per_request, int) and self.max_failures_per_request >= 1):
            raise ValueError("max_failures_per_request must be an integer >= 1, got "
                             f"{self.max_failures_per_request!r}")
        self.driver_wait = self.driver_wait.strip().lower()
        _check_choice("driver_wait", self.driver_wait, ("auto", "spin", "poll"))
        if self.fault_inject:
            FaultSpec.parse(self.fault_inject)  # a malformed spec fails here, not in a stage


@dataclass
class EngineConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    device: str = "auto"
    # speculative decoding (a dict is taken as SpeculativeConfig's fields); None: off
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """The config of ``LLM(model, **kwargs)``, the one mapping of engine options:
        ``LLM``, ``AsyncLLMEngine.from_model`` and the command line all build theirs
        here. Each option is a field of one section's config (``device`` of this one);
        one left out takes its default (``RAYPP_*`` where there is one). An unknown
        option raises :class:`UnknownOptionError` naming it and its close
        matches, before anything else is checked."""
        owners = _option_owners()
        unknown = sorted(set(kwargs) - set(owners))
        if unknown:
            raise UnknownOptionError(_unknown_options(unknown, list(owners)))
        parts: dict[type, dict[str, Any]] = {owner: {} for owner in owners.values()}
        for name, value in kwargs.items():
            parts[owners[name]][name] = value
        if parts[ModelConfig].get("cache_dir") is None:
            parts[ModelConfig]["cache_dir"] = str(cache_dir())
        return cls(model=ModelConfig(model, **parts[ModelConfig]),
                   parallel=ParallelConfig(**parts[ParallelConfig]),
                   cache=CacheConfig(**parts[CacheConfig]),
                   scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                   runtime=RuntimeConfig(**parts[RuntimeConfig]), **parts[cls])

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None:
            self.speculative_config.bind(self.model)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check_choice("device", self.device, ("cpu", "cuda"))
        pc = self.parallel
        if self.device == "cpu" and pc.workers_per_gpu != 1:
            raise ValueError(f"workers_per_gpu={pc.workers_per_gpu} places workers "
                             "on GPUs; it applies to device='cuda' only")
        if (pc.workers_per_gpu > 1 and pc.pipeline_parallel_size > 1 and pc.control_plane == "cgraph"
                and not pc.use_ray_wrapped_pp_comm):
            raise ValueError("use_ray_wrapped_pp_comm=False makes Ray carry PP tensors over its own "
                             "NCCL communicator, which refuses two workers on one GPU; keep "
                             "RayPPCommunicator (the default) with workers_per_gpu > 1")
        if self.runtime.driver_wait == "auto":  # spinning costs a core, which a CPU host lacks
            self.runtime.driver_wait = "spin" if self.device == "cuda" else "poll"
        pp = self.parallel.pipeline_parallel_size
        self.scheduler.size_for(self.device, pp, stages_share_device=pc.workers_per_gpu > 1)
        if self.scheduler.num_decode_steps > 1 and pp > 1:
            raise ValueError(
                f"num_decode_steps={self.scheduler.num_decode_steps} needs "
                f"pipeline_parallel_size=1 (got {pp}): each sampled token must feed the first "
                "stage again; use num_decode_steps=1 with pipeline parallelism"
            )
        _check_tp_divisibility(self.model, self.parallel.tensor_parallel_size)
        draft = self.speculative_config.draft if self.speculative_config else None
        if draft is not None:  # the first stage's TP ranks split the draft as they split it
            try:
                _check_tp_divisibility(draft, self.parallel.tensor_parallel_size)
            except ValueError as e:
                raise ValueError(f"speculative_config model (the draft): {e}") from None
        # Validates the split now, in the caller's process, with a clear error.
        self.stage_layers()

    def stage_layers(self) -> list[tuple[int, int]]:
        """``[start, end)`` global layer range of each pipeline stage: ``layer_partition``,
        else an even split, else (layers of different sizes) a split balancing parameter
        bytes (:func:`raypp.model.partition.stage_partition`)."""
        from raypp.model.partition import stage_partition
        from raypp.model.quantization.linear import Fp8Format

        mc, pc = self.model, self.parallel
        # CUDA workers hold FP8 linears in one byte per weight (CPU: dequantized)
        fp8 = (Fp8Format(mc.quant_config.group)
               if mc.quant_config is not None and self.device == "cuda" else None)
        return stage_partition(mc.hf_config, mc.architecture, mc.torch_dtype,
                               pc.pipeline_parallel_size, pc.layer_partition, fp8)

    @property
    def executor_depth(self) -> int:
        """Steps an executor must accept at once: ``max_inflight`` plus the scheduler's
        ``rounds_ahead``."""
        return self.scheduler.max_inflight + self.scheduler.rounds_ahead


class UnknownOptionError(ValueError, TypeError):
    """An engine option no config has (``LLM(model, pipeline_paralel_size=2)``): a bad
    value like every other config error, and a ``TypeError`` like any unknown keyword."""


def _option_owners() -> dict[str, type]:
    """Engine option -> the config class it is a field of."""
    owners = {f.name: c for c in (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig,
                                  RuntimeConfig) for f in fields(c) if f.init}
    del owners["model"]  # from_kwargs's own argument
    return {**owners, "device": EngineConfig, "speculative_config": EngineConfig}


def _unknown_options(unknown: list[str], known: list[str]) -> str:
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3)
        named.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)"
                                    if close else ""))
    return f"unknown engine option{'s' * (len(unknown) > 1)}: {', '.join(named)}"


def _check_tp_divisibility(model: ModelConfig, tp: int) -> None:
    """``ValueError`` naming the dimension a TP split cannot divide."""
    if tp == 1:
        return
    heads, kv_heads = model.num_attention_heads, model.num_kv_heads
    if heads % tp:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"num_key_value_heads={kv_heads} is not divisible by "
                         f"tensor_parallel_size={tp}")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of "
                         f"num_key_value_heads={kv_heads}, so kv heads cannot be replicated")
    for key in ("intermediate_size", "moe_intermediate_size"):  # dense MLP, experts
        size = int(model.hf_config.get(key) or 0)
        if size % tp:
            raise ValueError(f"{key}={size} is not divisible by tensor_parallel_size={tp}")


def cache_dir() -> Path:
    """Where raypp caches what it downloads or derives (the demo model, GGUF metadata):
    ``RAYPP_CACHE_DIR``, else ``~/.cache/raypp``."""
    return Path(envs.RAYPP_CACHE_DIR or DEFAULT_CACHE_DIR).expanduser()


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def parse_partition(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f'layer partition must look like "3,2,2", got {text!r}') from None
