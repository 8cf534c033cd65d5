"""Speculative decoding: the n-gram and draft-model proposers, draft-length adaptation,
the last stage's acceptance rule, and engines with speculation against transformers and
against themselves without it (greedy and seeded sampling), across layouts and faults."""

from __future__ import annotations

import collections
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams
from raypp.config import EngineConfig
from raypp.engine.sequence import Sequence
from raypp.engine.speculative import MISSES_BEFORE_PAUSE, PAUSE_SCHEDULINGS, NgramProposer, Speculator
from raypp.errors import RequestFailedError
from raypp.speculative_config import SpeculativeConfig
from raypp.step import ResolvedStep, SamplingBatch, StepInput, StepMode
from raypp.testing import kill_stage_later
from raypp.worker import verifier

# drafts from 1-gram matches: a tiny random model repeats single tokens far more often
# than longer runs, so its steps verify drafts, some accepted, most not
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)



@pytest.fixture(scope="module")
def drafts(tiny_llama, tiny_llama_half, tmp_path_factory) -> dict[str, str]:
    """Draft models for ``tiny_llama``, by name: ``"self"`` (the target: every draft
    accepted), ``"half"`` (the target's first 3 of 6 layers, its embedding, norm and LM
    head: some drafts accepted) and ``"other"`` (another random 2-layer model with the
    same vocabulary: hardly any accepted)."""
    from raypp.testing.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path_factory.mktemp("draft_other"), architecture="llama",
                            seed=9, num_layers=2)
    return {"self": str(tiny_llama), "half": str(tiny_llama_half), "other": str(other)}


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _draft_spec(path: str, k: int) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


# -- the proposer and the draft length ------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(min_n=2, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert p.propose([1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # the latest occurrence
    # the 3-gram [1, 2, 3] recurs (followed by 8); the 2-gram [2, 3] later (followed by 9)
    assert p.propose([5, 1, 2, 3, 8, 6, 2, 3, 9, 1, 2, 3], 2) == [8, 6]
    assert p.propose([1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert p.propose([4, 4, 4], 5) == [4]  # what exists, however many were asked
    assert p.propose([1, 2, 1, 2], 0) == [] and p.propose([1], 3) == []
    assert NgramProposer(1, 1).propose([7, 5, 6, 5], 2) == [6, 5]


def _latest_ngram_continuation(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by its definition, in plain Python: for n from max_n down, the k
    tokens after the latest earlier occurrence of the last n tokens."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for i in range(length - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[length - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_drafts_from_a_history_kept_as_tokens_are_accepted():
    """The proposer's per-sequence token array, extended step by step (one token, a
    verification's several, across growths of its buffer), drafts exactly what the
    lookup's definition gives over the whole prompt + output."""
    import random

    from raypp.engine.sequence import DraftStats

    rng = random.Random(0)
    p = NgramProposer(min_n=1, max_n=4)
    seq = Sequence(0, "0", 0, [rng.randrange(8) for _ in range(200)], SamplingParams(), seed=0)
    seq.draft_stats = DraftStats(cap=5)
    for _ in range(300):
        assert p.draft(seq, 5) == _latest_ngram_continuation(seq.all_token_ids, 5, 1, 4)
        for min_n, max_n in ((2, 3), (3, 5)):
            assert (NgramProposer(min_n, max_n).propose(seq.all_token_ids, 3)
                    == _latest_ngram_continuation(seq.all_token_ids, 3, min_n, max_n))
        seq.output_token_ids.extend(rng.randrange(8) for _ in range(rng.choice([1, 1, 3, 6])))
    assert len(seq.draft_stats.history.of(seq)) == seq.num_tokens > 256 + 200
    for alphabet in [20, 60, 400] * 50:  # rarer matches: the shorter n-grams decide
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(2, 300))]
        assert p.propose(tokens, 4) == _latest_ngram_continuation(tokens, 4, 1, 4)
    shorter = Sequence(1, "1", 0, [3, 1, 2, 3, 1], SamplingParams(), seed=0)
    shorter.draft_stats = seq.draft_stats  # a history longer than its sequence rebuilds
    assert p.draft(shorter, 3) == p.propose(shorter.all_token_ids, 3) == [2, 3, 1]


def _seq(params: SamplingParams | None = None) -> Sequence:
    return Sequence(0, "0", 0, [1, 2, 3, 1, 2, 3, 1, 2], params or SamplingParams(), seed=0)


def test_draft_length_follows_acceptance_and_pauses_after_misses():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    seq = _seq()
    assert spec.draft(seq, limit=2) == [3, 1]  # the step's budget caps it
    assert spec.draft(seq, limit=9) == [3, 1, 2]  # as many as follow the match
    spec.observe(seq, drafted=4, accepted=1)
    assert seq.draft_stats.cap == 2 and len(spec.draft(seq, 9)) == 2
    spec.observe(seq, drafted=2, accepted=2)
    assert seq.draft_stats.cap == 3
    for _ in range(MISSES_BEFORE_PAUSE):
        spec.observe(seq, drafted=1, accepted=0)
    assert [spec.draft(seq, 9) for _ in range(PAUSE_SCHEDULINGS)] == [[]] * PAUSE_SCHEDULINGS
    assert spec.draft(seq, 9) == [3]  # tries again, one token
    assert (spec.verifications, spec.drafted, spec.accepted) == (5, 9, 3)
    assert spec.draft(_seq(SamplingParams(repetition_penalty=1.2)), 9) == []
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                         adaptive=False))
    seq = _seq()
    fixed.draft(seq, 2)
    fixed.observe(seq, drafted=2, accepted=0)
    assert fixed.draft(seq, 9) == [3, 1, 2]  # the cap stays at 4


def test_speculative_config_errors_name_the_problem(tiny_llama):
    model = str(tiny_llama)
    cases = [({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
             ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
             ({"num_speculative_tokens": 2, "lookup": 3}, "unknown speculative_config key"),
             ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of"),
             ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
              "prompt_lookup_min <= prompt_lookup_max"),
             ({"num_speculative_tokens": 2, "method": "draft_model"}, "needs 'model'"),
             ({"num_speculative_tokens": 2, "method": "ngram", "model": model},
              "'model' is for method 'draft_model'")]
    for value, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs(model, speculative_config=value)
    config = EngineConfig.from_kwargs(model, speculative_config={"num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2, method="ngram")


def test_draft_model_config_checks_the_draft_against_the_target(tiny_llama, tmp_path, caplog):
    """A missing draft, another vocabulary, too few positions for a given max_model_len
    and a TP split the draft cannot take are refused at config time, naming the draft and
    the numbers; with no max_model_len given, the draft's positions lower it."""
    model = str(tiny_llama)
    with pytest.raises(FileNotFoundError, match="speculative_config model .*no/such/draft"):
        EngineConfig.from_kwargs(model, speculative_config=_draft_spec("/no/such/draft", 2))
    bad = tmp_path / "draft"
    shutil.copytree(tiny_llama, bad)
    _edit_config(bad, vocab_size=500)
    with pytest.raises(ValueError, match="has vocab_size 500, the target .* has 384"):
        EngineConfig.from_kwargs(model, speculative_config=_draft_spec(str(bad), 2))
    _edit_config(bad, vocab_size=384, max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_position_embeddings 64, fewer than the target's "
                                         "max_model_len 100"):
        EngineConfig.from_kwargs(model, max_model_len=100,
                                 speculative_config=_draft_spec(str(bad), 2))
    with caplog.at_level(logging.WARNING, logger="raypp.speculative_config"):
        config = EngineConfig.from_kwargs(model, speculative_config=_draft_spec(str(bad), 2))
    assert config.model.max_model_len == 64  # none given: the draft's positions bound it
    assert "max_model_len lowered from the target's 256 to 64" in caplog.text
    assert EngineConfig.from_kwargs(model, max_model_len=64, speculative_config=_draft_spec(
        str(bad), 2)).speculative_config.draft.num_layers == 6
    _edit_config(bad, max_position_embeddings=256, num_attention_heads=3, num_key_value_heads=3,
                 head_dim=16)
    with pytest.raises(ValueError, match="the draft.*num_attention_heads=3 is not divisible"):
        EngineConfig.from_kwargs(model, tensor_parallel_size=2,
                                 speculative_config=_draft_spec(str(bad), 2))
    config = EngineConfig.from_kwargs(model, dtype="bfloat16",
                                      speculative_config=_draft_spec(model, 3))
    spec = config.speculative_config
    assert spec.method == "draft_model" and spec.draft.torch_dtype == torch.bfloat16
    assert SpeculativeConfig.of({"num_speculative_tokens": 1, "model": model}).method == (
        "draft_model")


# -- the acceptance rule ----------------------------------------------------------------------
def _verify_step(draft: list[int], seed: int, temperature: float = 1.0) -> ResolvedStep:
    """One row feeding token 0 and ``draft``, sampled with ``seed``."""
    n = len(draft) + 1
    sampling = SamplingBatch([temperature], [1.0], [0], [0.0], [seed], [0], [-1], [0.0], [0.0],
                             [1.0])
    step = StepInput(0, [0, *draft], [0, n], [n], [0], [n - 1], sampling,
                     mode=StepMode.VERIFY, draft_lens=[len(draft)])
    return ResolvedStep.of(step, [[0]], 16)


def test_the_agreeing_prefix_is_accepted_plus_the_next_sample():
    logits = torch.full((4, 8), -30.0)
    logits[0, 5] = logits[1, 6] = logits[2, 2] = logits[3, 7] = 0.0  # greedy: 5, 6, 2, 7
    step = _verify_step([5, 6, 1], seed=0, temperature=0.0)
    assert verifier.verified_rows(step) == [0, 1, 2, 3]
    assert verifier.drafts_of(step) == [[5, 6, 1]]
    tokens, logprobs = verifier.verify(logits, step)
    assert tokens == [[5, 6, 2]] and logprobs == [None]  # the third draft is rejected
    assert verifier.verify(logits, _verify_step([5, 6, 2], 0, 0.0))[0] == [[5, 6, 2, 7]]
    assert verifier.verify(logits, _verify_step([4, 6, 2], 0, 0.0))[0] == [[5]]
    batch = verifier.expand(step.sampling, [2])
    assert batch.output_index == [0, 1, 2] and batch.seeds == [0, 0, 0]


def _first_tokens(rule, draft: list[int], probs: torch.Tensor, trials: int) -> collections.Counter:
    """The first token each of ``trials`` seeded verifications emits under ``rule``."""
    logits = probs.log().expand(len(draft) + 1, -1).clone()
    counts: collections.Counter = collections.Counter()
    original = verifier.accepted_count
    verifier.accepted_count = rule
    try:
        for seed in range(trials):
            counts[verifier.verify(logits, _verify_step(draft, seed))[0][0][0]] += 1
    finally:
        verifier.accepted_count = original
    return counts


def _chi_square(counts: collections.Counter, probs: torch.Tensor, trials: int) -> float:
    return sum((counts[t] - trials * p) ** 2 / (trials * p) for t, p in enumerate(probs.tolist()))


def test_emitted_tokens_follow_the_target_distribution_and_a_wrong_rule_is_caught():
    """Seeded sampling with a draft: the first emitted token is distributed as the
    target's p (chi-square over 3000 fixed seeds, 7 degrees of freedom, under 24.3: the
    0.1 % critical value); a rule that accepts the draft whenever it is likely enough
    (p(x) > 0.2, a plausible mistake) fails the same test by far."""
    probs = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
    trials = 3000
    exact = _first_tokens(verifier.accepted_count, [1, 0], probs, trials)
    assert _chi_square(exact, probs, trials) < 24.3

    def too_eager(samples: list[int], draft: list[int]) -> int:
        return len(draft) if probs[draft[0]] > 0.2 else verifier.accepted_count(samples, draft)

    wrong = _first_tokens(too_eager, [1, 0], probs, trials)
    assert _chi_square(wrong, probs, trials) > 24.3 * 10


# -- engines -------------------------------------------------------------------------------
def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts of one repeated token drive the tiny random model into loops, which the
    n-gram proposer predicts (drafts accepted); a text prompt mostly does not."""
    return [[3] * 8, [100] * 12, [11] * 20, *corpus_prompts(llm.get_tokenizer(), [9])]


def test_quiet_rows_ride_rounds_ahead_a_few_short_rounds_at_a_time():
    """A round of rows that drafted nothing at their last QUIET_AFTER schedulings is
    continued ahead like one without speculation, QUIET_CHAIN_ROUNDS rounds in a row of
    at most QUIET_ROUND_STEPS steps; a fresh round starts a new chain; a row that drafts
    again is no longer quiet."""
    from raypp.config import SchedulerConfig
    from raypp.engine.micro_batch import MicroBatch, ScheduledSeq
    from raypp.engine.rounds import RoundPolicy
    from raypp.engine.speculative import QUIET_AFTER, QUIET_CHAIN_ROUNDS, QUIET_ROUND_STEPS

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                             num_decode_steps=16).size_for("cpu", pipeline_parallel_size=1)
    policy = RoundPolicy(config, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2))
    assert RoundPolicy(config).max_steps(False) == 16 > policy.max_steps(False) == QUIET_ROUND_STEPS
    spec = policy.speculator
    seq = Sequence(0, "0", 0, [1, 2, 3, 4, 5], SamplingParams(), seed=0)  # nothing recurs

    def round_(after: MicroBatch | None = None) -> MicroBatch:
        return MicroBatch([ScheduledSeq(seq, seq.num_tokens, 1, True)], 4,
                          StepMode.DECODE_ROUND, continues=after)

    fresh = round_()
    assert not policy.may_continue(fresh, 1, False)  # never scheduled with speculation yet
    for _ in range(QUIET_AFTER):
        assert spec.draft(seq, 9) == []
    chain = [fresh]
    while policy.may_continue(chain[-1], 1, False):
        chain.append(round_(after=chain[-1]))
    assert len(chain) == 1 + QUIET_CHAIN_ROUNDS
    assert policy.may_continue(round_(), 1, False)  # a fresh round: a new chain
    assert not policy.may_continue(round_(), 1, True)  # a waiting request could join
    seq.output_token_ids.extend([1, 2])  # [1, 2] recurs: a draft, so not quiet any more
    assert spec.draft(seq, 9) == [3, 4, 5, 1, 2][:3]
    assert not policy.may_continue(round_(), 1, False)


def _generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return [o for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)]


@pytest.mark.parametrize("layout", [
    dict(pipeline_parallel_size=1, k=1),
    dict(pipeline_parallel_size=2, k=3),
    dict(pipeline_parallel_size=3, k=5, control_plane="direct"),
    dict(tensor_parallel_size=2, k=3),
], ids=["pp1-k1", "pp2-k3", "pp3-direct-k5", "tp2-k3"])
def test_greedy_with_speculation_equals_transformers(ray_cluster, tiny_llama, layout):
    layout = dict(layout)
    spec = {**NGRAM, "num_speculative_tokens": layout.pop("k")}
    with LLM(str(tiny_llama), max_num_seqs=4, speculative_config=spec, **layout) as llm:
        prompts = _prompts(llm)
        outs = _generate(llm, prompts, GREEDY)
        stats = llm.engine.stats
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 24)
    assert stats.spec_drafted_tokens > stats.spec_accepted_tokens > 0
    if layout.get("pipeline_parallel_size") == 1:  # asynchronous rounds
        assert stats.rounds_ahead > 0  # quiet rows rode rounds ahead
    metrics = [o.metrics for o in outs]
    assert sum(m["spec_accepted_tokens"] for m in metrics) == stats.spec_accepted_tokens
    assert all(1 <= m["spec_mean_accepted_length"] <= 1 + spec["num_speculative_tokens"]
               for m in metrics if m["spec_verifications"])


@pytest.mark.parametrize("pp, plane, k, draft, extra", [
    (1, "cgraph", 3, "self", {}),
    (1, "cgraph", 3, "other", {"num_decode_steps": 4}),
    (1, "cgraph", 3, "half", {"tensor_parallel_size": 2}),
    (2, "cgraph", 1, "self", {}),
    (2, "cgraph", 3, "half", {}),
    (2, "cgraph", 5, "self", {}),
    (3, "cgraph", 3, "self", {}),
    (2, "direct", 3, "other", {}),
    (3, "direct", 5, "half", {}),
], ids=["pp1-k3-self", "pp1-k3-other-rounds", "tp2-k3-half", "pp2-k1-self", "pp2-k3-half",
        "pp2-k5-self", "pp3-k3-self", "pp2-direct-k3-other", "pp3-direct-k5-half"])
def test_greedy_with_a_draft_model_equals_transformers(ray_cluster, tiny_llama, drafts, pp,
                                                       plane, k, draft, extra):
    """The first stage's draft model proposes, the pipeline verifies: outputs are
    transformers' greedy tokens whatever the draft. The target as its own draft has
    (nearly) every draft accepted, which only a draft that ran on every prompt and
    accepted token can; the others are accepted partly (``half``, TP-split like the
    target under tp 2) or hardly (``other``, whose misses pause drafting: with decode
    rounds those rows run rounds, which the draft skips and catches up on)."""
    with LLM(str(tiny_llama), max_num_seqs=4, pipeline_parallel_size=pp, control_plane=plane,
             speculative_config=_draft_spec(drafts[draft], k), **extra) as llm:
        prompts = _prompts(llm)
        outs = _generate(llm, prompts, GREEDY)
        stats = llm.engine.stats
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 24)
    metrics = [o.metrics for o in outs]
    assert sum(m["spec_drafted_tokens"] for m in metrics) == stats.spec_drafted_tokens > 0
    assert sum(m["spec_accepted_tokens"] for m in metrics) == stats.spec_accepted_tokens
    if draft == "self":
        assert all(m["spec_acceptance_rate"] > 0.9 for m in metrics), metrics
        assert all(m["spec_mean_accepted_length"] > 0.9 * (k + 1) for m in metrics), metrics
    elif draft == "half":
        assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    else:
        assert stats.spec_accepted_tokens < 0.2 * stats.spec_drafted_tokens
        if pp == 1:  # paused rows are quiet: they rode rounds ahead, the draft caught up
            assert stats.rounds_ahead > 0


def test_the_draft_model_sees_chunked_prompts_and_cached_prefixes(ray_cluster, tiny_llama,
                                                                 drafts):
    """pp = 2, prompts prefilled in 16-token chunks (pipelined), then asked again (their
    leading blocks now come from the prefix cache): the target as its own draft accepts
    (nearly) everything both times, so the draft's KV held every prompt token, cached
    blocks' included; outputs equal transformers'. Stage 0 holds the draft's KV beside
    its own, so it has fewer blocks than stage 1, and the start-up table says why."""
    from raypp.executor.stage_pool import format_stage_table

    # a byte budget (the default CPU budget is capped at what max_num_seqs sequences can
    # fill, which both stages reach here): blocks then follow each stage's block bytes
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_num_batched_tokens=16,
             kv_cache_memory_bytes=8 * 2**20,
             speculative_config=_draft_spec(drafts["self"], 3)) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [40, 57])
        want = hf_greedy(tiny_llama, prompts, 24)
        for run in range(2):
            outs = _generate(llm, prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert all(o.metrics["spec_acceptance_rate"] > 0.9 for o in outs)
            assert [o.num_cached_tokens > 0 for o in outs] == [run == 1] * 2
        assert llm.engine.scheduler.num_overlapped_chunks > 0
        summary = llm.engine.executor.pool.stage_summary
    assert summary[0]["draft"]["layers"] == 6 and summary[1]["draft"] is None
    assert summary[0]["kv_blocks"] < summary[1]["kv_blocks"]
    assert "stage 0 also runs the draft model" in format_stage_table(summary, 0)


@pytest.mark.parametrize("pp, proposer", [(1, "ngram"), (2, "ngram"), (2, "draft")])
def test_seeded_sampling_and_stops_equal_decoding_without_speculation(ray_cluster, tiny_llama,
                                                                      drafts, pp, proposer):
    """Seeded sampling with logprobs, n = 2, stop strings, stop ids and max_tokens: token
    for token, logprob for logprob what the same engine samples without speculation
    (drafts from prompt lookup, or from the target's first half as a draft model)."""
    outs = {}
    for spec in (None, NGRAM if proposer == "ngram" else _draft_spec(drafts["half"], 3)):
        with LLM(str(tiny_llama), max_num_seqs=6, pipeline_parallel_size=pp, seed=5,
                 speculative_config=spec) as llm:
            prompts = _prompts(llm)
            tok = llm.get_tokenizer()
            stop_text = tok.decode(hf_greedy(tiny_llama, prompts[3:], 6)[0][3:5])
            params = [SamplingParams(temperature=0.9, top_k=40, seed=11, n=2, max_tokens=20,
                                     logprobs=2, ignore_eos=True),
                      SamplingParams(temperature=0.7, seed=3, max_tokens=7, ignore_eos=True),
                      SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[199]),
                      SamplingParams(temperature=0, max_tokens=24, stop=[stop_text])]
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
            outs[spec is None] = [[(c.token_ids, c.text, c.finish_reason,
                                    c.logprobs and [sorted(lp) for lp in c.logprobs])
                                   for c in o.outputs] for o in got]
            if spec:
                assert llm.engine.stats.spec_accepted_tokens > 0
    assert outs[False] == outs[True]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_preemption_with_speculation_keeps_greedy_outputs(ray_cluster, tiny_llama, drafts,
                                                          proposer):
    """Few cache blocks: drafts never preempt anyone, and preempted sequences come back
    with the same outputs (a draft model's KV recomputed with the target's)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = NGRAM if proposer == "ngram" else _draft_spec(drafts["half"], 3)
    with LLM(str(tiny_llama), max_model_len=64, block_size=8, num_blocks_override=12,
             max_num_seqs=8, speculative_config=spec) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [8, 9, 11, 13, 15, 17])
        outs = [o.outputs[0].token_ids for o in _generate(llm, prompts, params)]
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_drafted_tokens > 0
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert outs == hf_greedy(tiny_llama, prompts, 30)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_stage_fault_mid_verification_fails_its_step_and_the_next_is_exact(ray_cluster,
                                                                             tiny_llama, drafts,
                                                                             proposer):
    """Step 1 is the first decode step, and every prompt ends in a token it already
    holds, so it verifies drafts (a draft model drafts on every decode step): a fault in
    the last stage there fails that step's requests; the requests after it, drafted and
    verified again, equal transformers."""
    spec = NGRAM if proposer == "ngram" else _draft_spec(drafts["self"], 3)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_num_seqs=3, max_inflight=1,
             speculative_config=spec, fault_inject="raise:1:1") as llm:
        text = corpus_prompts(llm.get_tokenizer(), [6, 9])
        # each ends in a token it holds already: the first decode step drafts
        prompts = [[3] * 8, [100] * 12, text[0] + text[0][:2], [3] * 9, [100] * 13,
                   text[1] + text[1][:2]]
        with pytest.raises(RequestFailedError) as err:
            _generate(llm, prompts, GREEDY)
        failure = err.value
        assert sorted(failure.errors) == [0, 1, 2]
        assert all("injected fault at step 1" in e for e in failure.errors.values())
        want = hf_greedy(tiny_llama, prompts, 24)
        assert [o.outputs[0].token_ids for o in failure.outputs[3:]] == want[3:]
        assert llm.engine.stats.spec_accepted_tokens > 0
        blocks = llm.engine.block_manager
        assert blocks.num_free == blocks.num_blocks and llm.is_healthy()


@pytest.mark.parametrize(("plane", "proposer"), [("cgraph", "ngram"), ("direct", "ngram"),
                                                  ("cgraph", "draft"), ("direct", "draft")])
def test_a_stage_killed_mid_verification(ray_cluster, tiny_llama, drafts, plane, proposer):
    """pp=2, every step a verification: stage 0 stalls on step 3 and stage 1 is killed
    meanwhile. No request is lost: each is re-queued and continues to transformers'
    output; the replaced stages verify drafts again, exactly. With a draft model, the
    replaced stage 0's draft cache starts empty: the re-queued sequences' draft KV count
    restarts with their tables, so the recompute refills it (nearly every draft of the
    target as its own draft is accepted again)."""
    spec = NGRAM if proposer == "ngram" else _draft_spec(drafts["self"], 3)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, control_plane=plane, max_restarts=5,
             speculative_config=spec, fault_inject="sleep:0:3:4") as llm:
        prompts = [[3] * 8, [100] * 12]  # repeated tokens: every decode step drafts
        killer = kill_stage_later(llm, 1, 1.5)
        got = _generate(llm, prompts, GREEDY)  # zero-loss recovery: re-queued, exact
        assert [o.outputs[0].token_ids for o in got] == hf_greedy(tiny_llama, prompts, 24)
        killer.join()
        accepted = llm.engine.stats.spec_accepted_tokens
        again = _generate(llm, prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == hf_greedy(tiny_llama, prompts, 24)
        assert llm.engine.restarts == 1 and llm.engine.stats.spec_accepted_tokens > accepted
        if proposer == "draft":
            assert all(o.metrics["spec_acceptance_rate"] > 0.9 for o in again)


def test_a_draft_model_loads_fp8_checkpoints_and_follows_the_fp8_kv_cache(ray_cluster,
                                                                         tiny_llama, tmp_path):
    """The draft is loaded as the target would be: a block-FP8 copy of the target (its
    own format, dequantized at load on CPU; read without its scales it would not load)
    drafts much of what the target samples (a random tiny model's near-ties part them), and
    with ``kv_cache_dtype="fp8"`` its cache takes one byte an element too. Greedy outputs
    equal the same engine's without speculation."""
    from raypp.testing.fp8_checkpoint import quantize_checkpoint

    draft = quantize_checkpoint(tiny_llama, tmp_path / "draft_fp8", "block")
    outs, summary = {}, None
    for spec in (None, _draft_spec(str(draft), 3)):
        with LLM(str(tiny_llama), kv_cache_dtype="fp8", kv_cache_memory_bytes=8 * 2**20,
                 speculative_config=spec) as llm:
            prompts = corpus_prompts(llm.get_tokenizer(), [9, 30])
            got = _generate(llm, prompts, GREEDY)
            outs[spec is None] = [o.outputs[0].token_ids for o in got]
            if spec is not None:
                summary = llm.engine.executor.pool.stage_summary
                assert all(o.metrics["spec_acceptance_rate"] > 0.3 for o in got), \
                    [o.metrics["spec_acceptance_rate"] for o in got]
    assert outs[True] == outs[False]
    # tiny_llama: 6 layers × 2 × 16 tokens × 2 kv heads × 16 dims per block, e4m3
    assert summary[0]["draft"]["block_bytes"] == 6 * 2 * 16 * 2 * 16


def test_constrained_and_biased_rows_ride_along_in_verify_steps(ray_cluster, tiny_llama):
    """A regex-constrained request and a logit-biased one never draft, but share VERIFY
    steps with rows that do: every output equals the same engine's without speculation."""
    params = [GREEDY, GREEDY,
              SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": "[a-z ]{4,30}"}),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={7: 8.0})]
    outs = {}
    for spec in (None, NGRAM):
        with LLM(str(tiny_llama), max_num_seqs=4, speculative_config=spec) as llm:
            prompts = _prompts(llm)
            outs[spec is None] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            if spec:
                assert llm.engine.stats.spec_accepted_tokens > 0
    assert outs[True] == outs[False]
