"""Turns a scheduled batch into one forward pass and one sampling call on a backend."""
from __future__ import annotations

import numpy as np

from ..backends.base import ForwardBatch, SamplingTensors
from ..config import ModelConfig
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, config: ModelConfig, backend):
        self.config = config
        self.backend = backend
        self.block_size = backend.block_size

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        # plain Python lists, one numpy conversion each at the end: at a few hundred
        # sequences per decode step, per-sequence numpy calls would cost milliseconds
        bs = self.block_size
        token_ids, positions, slots, seq_lens, query_start_loc = [], [], [], [], [0]
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = np.full((len(batch.seqs), max_blocks), -1, dtype=np.int32)
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, table = seq.num_computed_tokens, seq.block_table
            token_ids += seq.token_slice(start, start + n)
            new_positions = range(start, start + n)
            positions += new_positions
            slots += [table[p // bs] * bs + p % bs for p in new_positions]
            seq_lens.append(start + n)
            query_start_loc.append(query_start_loc[-1] + n)
            block_tables[b, :len(table)] = table
        return ForwardBatch(
            token_ids=np.array(token_ids, dtype=np.int32),
            positions=np.array(positions, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            query_start_loc=np.array(query_start_loc, dtype=np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32), block_tables=block_tables,
            max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens))

    def run(self, batch: ScheduledBatch) -> np.ndarray:
        """One forward pass; returns a sampled token id for every scheduled sequence
        (the caller keeps only those of sequences whose prompt is fully computed)."""
        logits = self.backend.forward(self.config, self.build_batch(batch))
        return self.backend.ops.sample(logits, sampling_tensors(batch))


def sampling_tensors(batch: ScheduledBatch) -> SamplingTensors:
    params = [seq.params for seq in batch.seqs]
    return SamplingTensors(
        temperature=np.array([p.temperature for p in params], dtype=np.float32),
        top_k=np.array([p.top_k for p in params], dtype=np.int32),
        top_p=np.array([p.top_p for p in params], dtype=np.float32),
        min_p=np.array([p.min_p for p in params], dtype=np.float32),
        seeds=np.array([seq.seed for seq in batch.seqs], dtype=np.uint64),
        # the step index is the number of tokens generated so far, so a recomputed
        # (preempted) sequence draws the same random numbers again
        steps=np.array([len(seq.output_token_ids) for seq in batch.seqs], dtype=np.int32))
