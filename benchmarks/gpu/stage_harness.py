"""One :class:`~raypp.worker.worker.StageWorker` in this process (no Ray; an NCCL world
of one), fed hand-built steps: what the stage sections and the decode-loop probe time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.gpu.decode_workload import MAX_MODEL_LEN


class StageHarness:
    """A one-stage pipeline on ``cuda:0`` with ``num_blocks`` KV blocks; sequence ``i`` of a
    batch owns blocks ``[i·n, (i+1)·n)`` with ``n`` blocks per ``MAX_MODEL_LEN``.

    ``worker`` is the stage (its ``runner`` and ``decode_graphs`` are what the caller
    times); every step samples greedily.
    """

    def __init__(self, ckpt: Path, max_num_seqs: int, num_blocks: int):
        from raypp.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from raypp.distributed.ports import free_port
        from raypp.worker.worker import StageWorker

        config = EngineConfig(
            model=ModelConfig(str(ckpt), dtype="bfloat16", max_model_len=MAX_MODEL_LEN),
            cache=CacheConfig(num_blocks_override=num_blocks),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096),
            device="cuda",
        )
        self.block_size = config.cache.block_size
        self.worker = StageWorker(config, 0, 0)
        self.worker.init_distributed(f"tcp://127.0.0.1:{free_port()}")
        self.worker.load_model()
        self.worker.init_kv_cache(num_blocks)
        self.blocks_per_seq = -(-MAX_MODEL_LEN // self.block_size)

    def tables(self, batch: int) -> list[list[int]]:
        n = self.blocks_per_seq
        return [list(range(i * n, (i + 1) * n)) for i in range(batch)]

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Prefill every prompt (chunks of whole prompts); first sampled token of each."""
        tables = self.tables(len(prompts))
        firsts: list[int] = []
        per_step = max(1, 4096 // len(prompts[0]))
        for lo in range(0, len(prompts), per_step):
            group = list(range(lo, min(lo + per_step, len(prompts))))
            ids, pos, slots, qs, rows = [], [], [], [0], []
            for i in group:
                p = prompts[i]
                ids += p
                pos += list(range(len(p)))
                slots += [self._slot(tables[i], j) for j in range(len(p))]
                qs.append(len(ids))
                rows.append(len(ids) - 1)
            step = self._step(ids, pos, qs, [len(prompts[i]) for i in group],
                              [tables[i] for i in group], slots, rows, 0)
            firsts += [t[0] for t in self.worker.execute_step(step).token_ids]
        return firsts

    def decode_step(self, tokens: list[int], lengths: list[int], index: int,
                    num_steps: int = 1) -> Any:
        """Step feeding ``tokens`` at positions ``lengths`` (context grows by one)."""
        tables = self.tables(len(tokens))
        n = len(tokens)
        return self._step(tokens, list(lengths), list(range(n + 1)), [c + 1 for c in lengths],
                          tables, [self._slot(t, c) for t, c in zip(tables, lengths, strict=True)],
                          list(range(n)), index, num_steps, decode=True)

    def decode(self, tokens: list[int], lengths: list[int], index: int, num_steps: int = 1
               ) -> tuple[list[int], list[int]]:
        """Run ``num_steps`` decode steps in one call: (last tokens, new lengths)."""
        out = self.worker.execute_step(self.decode_step(tokens, lengths, index, num_steps))
        return [t[-1] for t in out.token_ids], [c + num_steps for c in lengths]

    @staticmethod
    def _step(ids, pos, qs, seq_lens, tables, slots, rows, index, num_steps=1,
              decode=False) -> Any:
        """``decode``: a decode round (as the engine's scheduler marks pure decode steps
        of a one-stage pipeline), else a plain forward."""
        from raypp.step import ResolvedStep, SamplingBatch, StepMode

        n = len(rows)
        sampling = SamplingBatch(
            temperature=[0.0] * n, top_p=[1.0] * n, top_k=[0] * n, min_p=[0.0] * n,
            seeds=[0] * n, output_index=[index] * n, num_logprobs=[-1] * n,
            presence_penalty=[0.0] * n, frequency_penalty=[0.0] * n,
            repetition_penalty=[1.0] * n, prompt_tokens=[[]] * n, output_tokens=[[]] * n)
        # rows are sequences 0..n-1 whose whole tables every step sends (start 0 replaces),
        # already resolved: the worker takes it as a step, the graphs as a resolved one
        seq_ids = list(range(len(tables)))
        return ResolvedStep(step_id=index, input_ids=ids, positions=pos, query_start=qs,
                            seq_lens=seq_lens, seq_ids=seq_ids, slot_mapping=slots,
                            sample_rows=rows, sampling=sampling, num_steps=num_steps,
                            mode=StepMode.DECODE_ROUND if decode else StepMode.FORWARD,
                            block_table_updates=[(i, 0, t) for i, t in zip(seq_ids, tables)],
                            block_tables=tables)

    def shutdown(self) -> None:
        self.worker.shutdown()
