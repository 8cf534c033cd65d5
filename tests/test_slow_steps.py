"""A slow step is not a stuck stage: long steps complete under a short step timeout.

Real engines on both control planes: a step made slow inside the forward on purpose
(``fault_inject="slow:…"``: the stage's progress counter keeps moving) and a real
8001-token prompt prefilled in one step, both far longer than the step timeout, complete
on the first workers with the outputs transformers computes. That a frozen stage is
still caught within the timeout is tests/test_faults.py's stuck-stage test; the watch's
rules are unit-tested in tests/test_liveness.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams
from raypp.distributed.local_pipes import LocalPipes
from raypp.testing.tiny_model import make_tiny_model

PROMPT_LEN = 8001


@pytest.fixture(scope="module")
def tiny_llama_8k(tmp_path_factory: pytest.TempPathFactory):
    """tests/conftest.py's tiny Llama with room for an 8k-token context."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_8k"), architecture="llama",
                           seed=0, max_position_embeddings=8320)


@pytest.mark.parametrize("plane", ["cgraph", "direct"])
def test_long_steps_complete_under_a_short_step_timeout(ray_cluster, tiny_llama_8k, plane):
    """Step 2 takes 8 s longer on stage 0 (stage 1 waits for it past nothing but progress),
    then one 8001-token prompt is prefilled in a single step; the step timeout is 3 s."""
    with LLM(str(tiny_llama_8k), pipeline_parallel_size=2, control_plane=plane,
             step_timeout_s=3, max_model_len=8192, max_num_batched_tokens=8192,
             fault_inject="slow:0:2:8") as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [5, 9])
        short = SamplingParams(temperature=0, max_tokens=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], short, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama_8k, prompts, 8)
        assert llm.engine.stats.max_step_wait_s > 3  # the slow step really outlasted it

        rng = random.Random(0)
        long_prompt = [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]
        out = llm.generate({"prompt_token_ids": long_prompt},
                           SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_8k, [long_prompt], 3)[0]
        assert llm.engine.restarts == 0


def test_a_pipe_receiver_waits_for_a_slow_sender_past_its_timeout():
    """The direct plane's receive of the previous stage's hand-off: a sender that starts
    long after the pipe's own timeout is waited for while the caller says so, and the
    wait ends at once when it says stop."""
    sender, receiver = LocalPipes(0, timeout_s=0.3), LocalPipes(1, timeout_s=0.3)
    addresses = {0: sender.address, 1: receiver.address}
    sender.connect_peers(addresses)
    receiver.connect_peers(addresses)
    try:
        late = threading.Timer(1.0, lambda: sender.send(torch.arange(4.0), dst=1))
        late.start()
        receiver.wait_message(0, keep_waiting=lambda: True)  # 1 s > the 0.3 s timeout
        out = torch.empty(4)
        receiver.recv_into(out, 0)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        late.join()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped waiting for a message from rank 0"):
            receiver.wait_message(0, keep_waiting=lambda: False)
        assert time.monotonic() - started < 5
    finally:
        sender.close()
        receiver.close()
