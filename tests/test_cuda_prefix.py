"""Prefix caching on the GPU: a prefill chunk reads the positions before it from the paged
cache, where an earlier call wrote them, at every offset.

For each sequence an earlier call (rope_and_cache) writes positions 0..offset-1 into blocks
scattered over a pool whose every slot starts as NaN; a second call writes the chunk's
positions offset.. and runs attention for them, as a step does after a prefix-cache hit.
Offsets 0 to 2 x block_size and a few larger ones, one sequence at a time and all in one
batch, chunks of 1 token (the decode kernels) to 200. The same calls on the NumPy reference
ops (on the same bf16 inputs, with the reference cache rounded to bf16 as the GPU stores
it) give the expected output, within the bars of docs/ARCHITECTURE.md, "Correctness
bars": attention atol 1.5e-2 / rtol 1e-2, cache writes bit-exact. A last case recomputes
a token whose K/V are cached already (a fully cached prompt's last token): its slot is -1
and the cache must keep the earlier call's K/V, which the attention reads. Needs CuPy and
a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_llama.interface import ForwardBatch
from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from test_cuda_ops import (BLOCK_SIZE, REF, _gpu_available, assert_close, make_ops, poisoned,
                           random_bf16, rng, rope_table, to_float)  # noqa: F401 (rng: a fixture)
from cupy_llama.util import cdiv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]

OFFSETS = list(range(2 * BLOCK_SIZE + 1)) + [100, 255, 1000]
NUM_KV_HEADS = 2


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x as the GPU stores it (NaN stays NaN)."""
    return bf16_bits_to_float32(float32_to_bf16_bits(x))


class PagedCase:
    """Sequences [(offset, chunk)] laid out in blocks scattered over a pool four times as
    large as they need, the same block ids on the GPU and in the reference; caches NaN
    everywhere to start with."""

    def __init__(self, cp, rng, seqs, head_dim, group):
        self.cp, self.seqs, self.head_dim = cp, seqs, head_dim
        self.num_heads = NUM_KV_HEADS * group
        self.width_qkv = (self.num_heads + 2 * NUM_KV_HEADS) * head_dim
        lengths = [offset + chunk for offset, chunk in seqs]
        blocks_per_seq = [cdiv(n, BLOCK_SIZE) for n in lengths]
        self.width = max(blocks_per_seq)
        num_pool_blocks = 4 * sum(blocks_per_seq) + 16
        ids = rng.choice(num_pool_blocks, sum(blocks_per_seq), replace=False).astype(np.int32)
        self.tables = np.full((len(seqs), self.width), -1, np.int32)
        start = 0
        for b, n in enumerate(blocks_per_seq):
            self.tables[b, :n] = ids[start:start + n]
            start += n
        # every position's qkv, per sequence: the earlier call takes rows :offset, the chunk
        # the rest
        self.qkv = [random_bf16(rng, (n, self.width_qkv)) for n in lengths]
        shape = (num_pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
        self.k_ref = np.full(shape, np.nan, np.float32)
        self.v_ref = np.full(shape, np.nan, np.float32)
        self.k_gpu, self.v_gpu = poisoned(cp, shape), poisoned(cp, shape)
        max_pos = max(lengths) + 1
        self.cos_sin = rope_table(max_pos, head_dim)
        self.cos_sin_gpu = cp.asarray(self.cos_sin)
        self.ops = make_ops(max(sum(lengths), 1), len(seqs), self.width, self.num_heads,
                            head_dim, max_model_len=self.width * BLOCK_SIZE)

    def batch(self, ranges, unwritten=()) -> ForwardBatch:
        """Positions [first, end) of each sequence; (b, position) in `unwritten` get slot -1."""
        positions, slots, query_start_loc = [], [], [0]
        for b, (first, end) in enumerate(ranges):
            for p in range(first, end):
                positions.append(p)
                block = self.tables[b, p // BLOCK_SIZE]
                slots.append(-1 if (b, p) in unwritten else block * BLOCK_SIZE + p % BLOCK_SIZE)
            query_start_loc.append(len(positions))
        num_new = np.diff(query_start_loc)
        seq_lens = np.array([end for _, end in ranges], np.int32)
        return ForwardBatch(
            token_ids=np.zeros(len(positions), np.int32), positions=np.array(positions, np.int32),
            slot_mapping=np.array(slots, np.int32),
            query_start_loc=np.array(query_start_loc, np.int32), seq_lens=seq_lens,
            block_tables=self.tables, max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()))

    def rows(self, ranges, qkv=None):
        """The qkv rows of those positions: (bf16 bits, float32)."""
        qkv = qkv or self.qkv
        bits = np.concatenate([qkv[b][0][first:end] for b, (first, end) in enumerate(ranges)])
        values = np.concatenate([qkv[b][1][first:end] for b, (first, end) in enumerate(ranges)])
        return bits, values

    def write(self, ranges, qkv=None, unwritten=()):
        """rope_and_cache of those positions on both sides; returns the batch and the
        rotated queries (GPU array, reference rounded to bf16)."""
        cp, batch = self.cp, self.batch(ranges, unwritten)
        bits, values = self.rows(ranges, qkv)
        q_gpu = poisoned(cp, (batch.num_tokens, self.num_heads, self.head_dim))
        meta = self.ops.upload(batch)
        self.ops.rope_and_cache(cp.asarray(bits), meta, self.cos_sin_gpu, self.k_gpu, self.v_gpu,
                                q_gpu)
        q_ref = np.empty((batch.num_tokens, self.num_heads, self.head_dim), np.float32)
        REF.rope_and_cache(values, batch, self.cos_sin, self.k_ref, self.v_ref, q_ref)
        self.k_ref[...] = bf16_round(self.k_ref)
        self.v_ref[...] = bf16_round(self.v_ref)
        return batch, meta, q_gpu, bf16_round(q_ref)

    def attend(self, ranges, qkv=None, unwritten=()):
        """Write the chunk and run attention for it on both sides: (GPU out, expected)."""
        batch, meta, q_gpu, q_ref = self.write(ranges, qkv, unwritten)
        scale = self.head_dim ** -0.5
        out = poisoned(self.cp, (batch.num_tokens, self.num_heads * self.head_dim))
        self.ops.attention(q_gpu, self.k_gpu, self.v_gpu, meta, scale, out)
        expected = np.empty((batch.num_tokens, self.num_heads * self.head_dim), np.float32)
        REF.attention(q_ref, self.k_ref, self.v_ref, batch, scale, expected)
        return to_float(self.cp, out), expected

    def assert_caches_match(self, what):
        for name, got, ref in (("k", self.k_gpu, self.k_ref), ("v", self.v_gpu, self.v_ref)):
            got_bits, ref_bits = self.cp.asnumpy(got), float32_to_bf16_bits(ref)
            mismatch = got_bits != ref_bits  # never-written slots: NaN on both sides
            assert not mismatch.any(), (
                f"{what}: {name} cache differs from the reference in {mismatch.sum()} elements "
                f"(first at {tuple(np.argwhere(mismatch)[0])})")


def prefix_then_chunk(cp, rng, seqs, head_dim, group, what):
    case = PagedCase(cp, rng, seqs, head_dim, group)
    earlier = [(0, offset) for offset, _ in seqs]
    if any(offset for offset, _ in seqs):
        case.write(earlier)  # the earlier call: only the cached prefixes
    got, expected = case.attend([(offset, offset + chunk) for offset, chunk in seqs])
    assert_close(got, expected, 1.5e-2, 1e-2, what)
    case.assert_caches_match(what)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("chunk", [1, 17])
def test_a_chunk_reads_the_cached_prefix_at_every_offset(cp, rng, head_dim, group, chunk):
    for offset in OFFSETS:
        prefix_then_chunk(cp, rng, [(offset, chunk)], head_dim, group,
                          f"offset {offset}, chunk {chunk}, d={head_dim}, group={group}")


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("chunk", [1, 5, 16, 17, 64, 200])
def test_every_offset_in_one_batch(cp, rng, head_dim, group, chunk):
    prefix_then_chunk(cp, rng, [(offset, chunk) for offset in OFFSETS], head_dim, group,
                      f"all offsets, chunk {chunk}, d={head_dim}, group={group}")


def test_mixed_chunks_in_one_batch(cp, rng):
    """A step as the scheduler makes it after hits: tails of many lengths at many offsets,
    decode rows among them."""
    seqs = [(offset, (offset * 7) % 40 + 1) for offset in OFFSETS]
    prefix_then_chunk(cp, rng, seqs, 64, 4, "mixed chunks")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_recomputed_cached_token_reads_its_cached_kv_and_writes_nothing(cp, rng, head_dim):
    """A prompt whose blocks are all cached computes its last token again (slot -1): its
    K/V are the earlier call's; this call's qkv for it differ, so a write would show."""
    lengths = [1, 15, 16, 17, 32, 33, 100, 256, 1000]
    case = PagedCase(cp, rng, [(n, 0) for n in lengths], head_dim, 4)
    case.write([(0, n) for n in lengths])  # every position, the last one's K/V included
    other = [random_bf16(rng, (n, case.width_qkv)) for n in lengths]
    last = [(n - 1, n) for n in lengths]
    unwritten = {(b, n - 1) for b, n in enumerate(lengths)}
    got, expected = case.attend(last, qkv=other, unwritten=unwritten)
    assert_close(got, expected, 1.5e-2, 1e-2, f"recomputed last tokens, d={head_dim}")
    case.assert_caches_match(f"recomputed last tokens, d={head_dim}")
