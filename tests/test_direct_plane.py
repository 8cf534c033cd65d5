"""The ``direct`` control plane: same outputs as transformers and as the compiled
graph, micro-batches really in flight, idle stages asleep, dead stages reported
within seconds, nothing left behind on shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from raypp import LLM, RequestFailedError, SamplingParams
from raypp.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from raypp.errors import StageDiedError
from raypp.executor.base import make_executor
from raypp.executor.direct import DirectExecutor
from raypp.step import SamplingBatch, StepInput
from raypp.testing import cpu_use_against_idle_actor

KV_BYTES = 16 * 2**20
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
TEXTS = ["The list type", "A", "Assert statements are a convenient way to insert debugging",
         "def ", "Exceptions are raised when"]

def _llm(model_dir: Path, plane: str, pp: int, **kwargs) -> LLM:
    llm = LLM(str(model_dir), pipeline_parallel_size=pp, control_plane=plane,
              kv_cache_memory_bytes=KV_BYTES, **kwargs)
    assert llm.engine.executor.control_plane == plane
    return llm


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.get_tokenizer().encode(t) for t in TEXTS]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


_HF: dict[str, torch.nn.Module] = {}


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy ``generate`` on the same checkpoint, cut after EOS."""
    import transformers

    key = str(model_dir)
    if key not in _HF:
        _HF[key] = transformers.AutoModelForCausalLM.from_pretrained(
            key, dtype=torch.float32).eval()
    model = _HF[key]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                               do_sample=False, pad_token_id=model.config.pad_token_id)
        new = y[0, len(ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        outs.append(new[:cut])
    return outs


@pytest.fixture(scope="module")
def engines(ray_cluster):
    """Engines shared by this module's tests: ``(model_dir, plane, pp) -> LLM``."""
    cache: dict[tuple[str, str, int], LLM] = {}

    def get(model_dir: Path, plane: str, pp: int) -> LLM:
        key = (str(model_dir), plane, pp)
        if key not in cache:
            cache[key] = _llm(model_dir, plane, pp)
        return cache[key]

    get.cache = cache
    yield get
    for llm in cache.values():
        llm.shutdown()


def _stage_pids(llm: LLM) -> list[int]:
    return ray.get([lane[0].ping.remote() for lane in llm.engine.executor.workers], timeout=30)


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- correctness --------------------------------------------------------------------------


SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=MAX_NEW)


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_equals_transformers_and_cgraph(engines, tiny_llama, pp):
    direct = engines(tiny_llama, "direct", pp)
    prompts = _prompts(direct)
    got, seeded = _generate(direct, prompts), _generate(direct, prompts, SEEDED)
    assert got == _hf_greedy(tiny_llama, prompts, MAX_NEW)
    with _llm(tiny_llama, "cgraph", pp) as cgraph:
        assert _generate(cgraph, prompts) == got
        assert _generate(cgraph, prompts, SEEDED) == seeded


def test_tensor_parallel_lanes_equal_transformers_and_tp1(engines, tiny_llama):
    """tp=2 × pp=2: every worker runs a loop, each lane over its own PP group."""
    direct = _llm(tiny_llama, "direct", 2, tensor_parallel_size=2)
    try:
        assert len(direct.engine.executor.stage_pids) == 4
        prompts = _prompts(direct)
        got, seeded = _generate(direct, prompts), _generate(direct, prompts, SEEDED)
        stats = direct.engine.executor.comm_stats()
    finally:
        direct.shutdown()
    assert got == _hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert seeded == _generate(engines(tiny_llama, "direct", 2), prompts, SEEDED)
    assert [(s["pp_rank"], s["tp_rank"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["sends"] > 0 for s in stats[:2]) and all(s["recvs"] > 0 for s in stats[2:])


def test_qwen2_equals_transformers_and_shutdown_is_clean(ray_cluster, tiny_qwen2, caplog):
    with _llm(tiny_qwen2, "direct", 2) as llm:
        prompts = _prompts(llm)
        got = _generate(llm, prompts)
        pids = _stage_pids(llm)
    assert got == _hf_greedy(tiny_qwen2, prompts, MAX_NEW)
    assert "did not stop" not in caplog.text  # loops acknowledged the stop before the kill
    assert _wait_gone(pids, within_s=10) == []


# -- pipelining -----------------------------------------------------------------------------


def _overlaps(intervals: list[tuple[int, float, float]]) -> int:
    """Pairs of compute intervals on different stages that overlap in time."""
    return sum(1 for i, (sa, a0, a1) in enumerate(intervals) for sb, b0, b1 in intervals[i + 1:]
               if sa != sb and a0 < b1 and b0 < a1)


def test_micro_batches_are_in_flight_together(engines, tiny_llama):
    llm = engines(tiny_llama, "direct", 2)
    engine, executor = llm.engine, llm.engine.executor
    prompts = _prompts(llm) * 2
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.trace_steps = True
    try:
        executor.traced_intervals()  # drop older intervals
        engine.config.scheduler.max_inflight = 1
        _generate(llm, prompts, long)
        serial = executor.traced_intervals()
        engine.config.scheduler.max_inflight = 2
        _generate(llm, prompts, long)
        pipelined = executor.traced_intervals()
    finally:
        engine.trace_steps = False
        engine.config.scheduler.max_inflight = 2
    assert serial and pipelined
    assert _overlaps(serial) == 0  # one micro-batch at a time: stages take turns
    assert _overlaps(pipelined) >= 5  # two in flight: both stages compute at once


def test_executor_over_tcp_pipelines_and_matches_transformers(ray_cluster, tiny_llama):
    """Executor level, socket transport: two steps submitted before either result."""
    config = EngineConfig(model=ModelConfig(str(tiny_llama)), parallel=ParallelConfig(2),
                          cache=CacheConfig(kv_cache_memory_bytes=KV_BYTES), device="cpu")
    executor = DirectExecutor(config, transport="tcp")
    try:
        assert all(q.address.startswith("tcp://127.0.0.1:") for q in executor._steps)
        prompts = [[5, 17, 42, 8], [99, 3, 250]]
        handles = [executor.submit(_prefill_step(i, ids, first_block=4 * i))
                   for i, ids in enumerate(prompts)]
        outs = [executor.result(h, timeout=30) for h in reversed(handles)][::-1]
        assert [o.step_id for o in outs] == [0, 1]
        assert [o.token_ids for o in outs] == [[hf[:1]] for hf in _hf_greedy(tiny_llama, prompts, 1)]
        assert executor.check_health()
    finally:
        executor.shutdown()
    assert not executor.check_health()


def _prefill_step(step_id: int, ids: list[int], first_block: int) -> StepInput:
    n = len(ids)
    greedy = SamplingBatch(temperature=[0.0], top_p=[1.0], top_k=[0], min_p=[0.0], seeds=[0],
                           output_index=[0], num_logprobs=[-1], presence_penalty=[0.0],
                           frequency_penalty=[0.0], repetition_penalty=[1.0],
                           prompt_tokens=[[]], output_tokens=[[]])
    return StepInput(step_id=step_id, input_ids=ids, query_start=[0, n], seq_lens=[n],
                     seq_ids=[step_id], block_table_updates=[(step_id, 0, [first_block])],
                     sample_rows=[n - 1], sampling=greedy)


# -- idle cost --------------------------------------------------------------------------------


def test_idle_stages_use_almost_no_cpu(engines, tiny_llama):
    """Idle stages block in zmq_poll: over a quiet window they cost about what an idle Ray
    actor costs (Ray's own threads: ~1 % of a core here; the stages 2-5 %, depending on
    the box's load), far from a spinning loop's ~100 %."""
    llm = engines(tiny_llama, "direct", 2)
    _generate(llm, _prompts(llm)[:1])
    stages, baseline = cpu_use_against_idle_actor(_stage_pids(llm), 3.0)
    assert max(stages) <= baseline + 0.10, (
        f"idle stage CPU use (fraction of a core): {stages}; an idle Ray actor: {baseline:.3f}")


# -- faults ---------------------------------------------------------------------------------


def test_stage_error_fails_only_its_step(ray_cluster, tiny_llama):
    # stage 1 raises at step id 3
    with _llm(tiny_llama, "direct", 3, max_num_seqs=len(TEXTS), fault_inject="raise:1:3") as llm:
        prompts = _prompts(llm)
        with pytest.raises(RequestFailedError) as err:
            _generate(llm, prompts)
        failure = err.value
        assert 0 < len(failure.errors) < len(prompts)
        assert all("stage 1" in e and "injected fault at step 3" in e
                   for e in failure.errors.values())
        reference = _hf_greedy(tiny_llama, prompts, MAX_NEW)
        for index, out in enumerate(failure.outputs):
            if index not in failure.errors:
                assert out.outputs[0].token_ids == reference[index]
        assert llm.is_healthy() and llm.engine.restarts == 0
        assert _generate(llm, prompts) == reference  # the same pipeline serves on


def _kill_soon(actor, delay: float, killed_at: list[float]) -> threading.Thread:
    def kill() -> None:
        time.sleep(delay)
        killed_at.append(time.monotonic())
        ray.kill(actor, no_restart=True)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_killed_stage_loses_no_request_and_leaves_nothing_behind(ray_cluster, tiny_llama):
    """A middle stage, then the last, killed mid-batch: the batch completes as it does
    without the kill (its requests re-queued on a fresh direct plane); the old executor
    stays down and fails fast, and no stage process outlives it."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with _llm(tiny_llama, "direct", 3, max_restarts=5) as llm:
        prompts = _prompts(llm)
        expected = _generate(llm, prompts * 2, long)
        for round_, victim in enumerate([1, 2]):  # a middle stage, then the last
            old = llm.engine.executor
            pids = _stage_pids(llm)
            killed_at: list[float] = []
            killer = _kill_soon(old.workers[victim][0], 1.0, killed_at)
            assert _generate(llm, prompts * 2, long) == expected
            killer.join()
            assert killed_at, "generation finished before the kill"
            assert not old.check_health()
            with pytest.raises(StageDiedError):  # the old executor stays down, fails fast
                old.submit(_prefill_step(10_000, [1, 2], first_block=0))
            assert _wait_gone(pids, within_s=10) == []  # no stage process left behind
            assert llm.engine.executor.control_plane == "direct"
            assert llm.engine.restarts == round_ + 1 and llm.is_healthy()


def test_unknown_control_plane_is_rejected_naming_the_planes(tiny_llama):
    with pytest.raises(ValueError, match="'cgraph', 'direct'"):
        ParallelConfig(control_plane="grpc")
    config = EngineConfig(model=ModelConfig(str(tiny_llama)), device="cpu")
    config.parallel.control_plane = "grpc"  # past validation: the registry still refuses
    with pytest.raises(ValueError, match="cgraph, direct"):
        make_executor(config)
