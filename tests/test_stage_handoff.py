"""The typed stage hand-off, built once and read by every path that consumes it: the
eager forward of the next stage, the decode-graph loader (its CPU part), and the direct
plane's transport (the tensors over real same-host pipes, then rebuilt). CPU, real
weights of the tiny Llama; the GPU replay of a non-first stage's graph is
tests/test_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

from raypp.config import ModelConfig
from raypp.distributed.local_pipes import LocalPipes
from raypp.model.base import StageSpec
from raypp.model.layers import TPContext
from raypp.model.llama import LlamaStageModel
from raypp.model.loader import load_stage_weights
from raypp.step import ResolvedStep, SamplingBatch, StageHandoff, StepInput
from raypp.worker.cuda_graphs import DecodeGraphs
from raypp.worker.model_runner import ModelRunner

BLOCK = 16


def _runner(model_dir, start: int, end: int) -> ModelRunner:
    mc = ModelConfig(str(model_dir), dtype="float32")
    stage = StageSpec(start, end, start == 0, end == mc.num_layers)
    model = LlamaStageModel(mc.hf_config, stage, TPContext(), torch.float32, "torch")
    load_stage_weights(model, mc.model)
    caches = [torch.zeros(2, 32, BLOCK, mc.num_kv_heads, mc.head_dim) for _ in range(end - start)]
    return ModelRunner(model.eval(), caches, None, torch.device("cpu"), BLOCK)


def _greedy(n: int) -> SamplingBatch:
    return SamplingBatch([0.0] * n, [1.0] * n, [0] * n, [0.0] * n, [0] * n, [0] * n, [-1] * n,
                         [0.0] * n, [0.0] * n, [1.0] * n, [[]] * n, [[]] * n)


def _prefill(prompts: list[list[int]]) -> StepInput:
    ids, query_start, tables = [], [0], []
    for i, p in enumerate(prompts):
        ids += p
        query_start.append(len(ids))
        tables.append([4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
    # sequences 0, 1, ...: new to every stage, so each step carries their whole tables
    seq_ids = list(range(len(prompts)))
    return StepInput(0, ids, query_start, [len(p) for p in prompts], seq_ids,
                     [s - 1 for s in query_start[1:]], _greedy(len(prompts)),
                     block_table_updates=[(i, 0, t) for i, t in zip(seq_ids, tables)])


def _pipes_round_trip(handoff: StageHandoff) -> StageHandoff:
    """Send the hand-off's tensors between two ranks' real same-host pipes, as the direct
    plane's loop does (``send_tensor_dict`` of ``tensors()``), and rebuild it."""
    sender, receiver = LocalPipes(0, 10.0), LocalPipes(1, 10.0)
    try:
        sender.connect_peers({1: receiver.address})
        receiver.connect_peers({0: sender.address})
        tensors = handoff.tensors()
        thread = threading.Thread(target=lambda: [sender.send(t, 1) for t in tensors.values()])
        thread.start()
        received = {}
        for name, t in tensors.items():
            received[name] = torch.empty_like(t)
            receiver.recv_into(received[name], 0)
        thread.join()
    finally:
        sender.close()
        receiver.close()
    return StageHandoff.from_tensors(handoff.step, received)


def test_handoff_packs_hidden_and_residual_in_one_tensor():
    step = _prefill([[1, 2, 3]])
    hidden, residual = torch.randn(3, 8), torch.randn(3, 8)
    handoff = StageHandoff.pack(step, hidden, residual)
    assert handoff.packed.shape == (2, 3, 8) and list(handoff.tensors()) == ["packed"]
    assert torch.equal(handoff.hidden_states, hidden) and torch.equal(handoff.residual, residual)
    again = StageHandoff.from_tensors(step, handoff.tensors())
    assert again.step is step and torch.equal(again.packed, handoff.packed)


def test_one_handoff_through_every_consumer(tiny_llama):
    whole, first, last = _runner(tiny_llama, 0, 6), _runner(tiny_llama, 0, 2), _runner(tiny_llama, 2, 6)
    step = _prefill([[5, 17, 42, 8, 1, 9], [99, 3, 250]])
    with torch.inference_mode():
        handoff = first.execute(step, None)
        assert isinstance(handoff, StageHandoff) and handoff.step is step
        want = whole.execute(step, None).token_ids
        # 1. the next stage's eager forward
        assert last.execute(step, handoff).token_ids == want
        # 2. the direct plane's transport, rebuilt on the other side
        moved = _pipes_round_trip(handoff)
        assert torch.equal(moved.packed, handoff.packed)
        assert last.execute(step, moved).token_ids == want
    # 3. the decode-graph loader of a non-first stage copies both parts into its buffers
    mc = ModelConfig(str(tiny_llama))
    decode = ResolvedStep.of(StepInput(1, [7, 8], [0, 1, 2], [7, 4], [0, 1], [0, 1], _greedy(2)),
                             [t for _, _, t in step.block_table_updates], BLOCK)
    assert decode.slot_mapping == [6, 4 * BLOCK + 3]
    hidden, residual = torch.randn(2, mc.hidden_size), torch.randn(2, mc.hidden_size)
    graphs = DecodeGraphs(last.model, last.kv_caches, is_first=False, is_last=True,
                          max_num_seqs=4, max_blocks_per_seq=4, hidden_size=mc.hidden_size,
                          dtype=torch.float32, device=torch.device("cpu"), compile_forward=False)
    assert graphs.can_run(decode)
    graphs.load(decode, StageHandoff.pack(decode, hidden, residual))
    assert torch.equal(graphs.buffers.hidden_states[:2], hidden)
    assert torch.equal(graphs.buffers.residual[:2], residual)
    assert graphs.buffers.positions[:2].tolist() == [6, 3]
    with pytest.raises(ValueError, match="needs the previous stage's hand-off"):
        graphs.load(decode, None)
    with pytest.raises(ValueError, match="needs the previous stage's hand-off"):
        last.execute(step, None)
