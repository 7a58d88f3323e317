"""CUDA-graph decode against the eager forward pass and the float32 reference, and the
custom skinny GEMM kernels against NumPy.

How close replay must be:
- to the SAME launches run eagerly (`DecodeGraphs.run_uncaptured`: same bucket, same
  padding, same split count, same cuBLAS calls): bit-identical, since a graph replays
  exactly those kernels with exactly those arguments, and every kernel here is
  deterministic;
- to the plain eager forward (B rows, not the bucket's, and a split count chosen from the
  batch's longest context): the products run with a different row count (cuBLAS may pick
  another algorithm) and attention sums its splits in another order, so single bf16
  roundings differ and grow over the layers; allowed 2e-2 of the largest logit;
- to the float32 CPU reference: the self-test's bar, 5e-2 of the largest logit.
Needs CuPy and a CUDA GPU for everything marked gpu."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from cupy_llama.interface import ForwardBatch
from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from cupy_llama.backends.cuda.graphs import decode_buckets
from cupy_llama.util import cdiv


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024  # up to 16 decode splits: long contexts below use several
NAN_BITS = 0x7FC0
EAGER_TOLERANCE = 2e-2
REFERENCE_TOLERANCE = 5e-2


def test_short_graph_buckets():
    """A second graph only where clustered attention runs at a context shorter than the
    graphs' own (the rule itself: test_attention_plan)."""
    from cupy_llama.backends.cuda.attention import decode_clusters_pay
    from cupy_llama.backends.cuda.graphs import short_graph_buckets
    buckets = [1, 2, 4, 8, 12]
    # 2 kv heads of 4 query heads, head_dim 64, 132 SMs: the CUDA-core clusters up to batch
    # 8 and 512 keys; from batch 8 on the tensor-core kernel's, at every context (their one
    # graph is clustered already)
    clustered = lambda bucket, limit: decode_clusters_pay(
        num_seqs=bucket, num_heads=8, num_kv_heads=2, head_dim=64, max_seq_len=limit, num_sms=132)
    assert short_graph_buckets(buckets, 512, 1024, clustered) == {1, 2, 4}
    assert short_graph_buckets(buckets, 512, 512, clustered) == set()  # nothing shorter
    assert short_graph_buckets(buckets, 0, 1024, lambda b, limit: True) == set()  # no cluster shape


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(10) == [1, 2, 4, 8, 10]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    buckets = decode_buckets(256)
    assert buckets[-1] == 256 and all(b - a == 16 for a, b in zip(buckets[6:], buckets[7:]))
    assert decode_buckets(70)[-2:] == [64, 70]


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------ whole model

class Sequences:
    """Sequences with fixed, scattered block tables; builds prefill and decode batches."""

    def __init__(self, prompts, num_kv_blocks, rng):
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
        order = rng.permutation(num_kv_blocks)
        self.tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq].astype(np.int32)
                       for i in range(len(prompts))]

    def batch(self, new_counts: dict) -> ForwardBatch:
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for b, n in new_counts.items():
            start = self.computed[b]
            pos = np.arange(start, start + n, dtype=np.int32)
            used = cdiv(start + n, BLOCK_SIZE)
            ids.append(np.asarray(self.tokens[b][start:start + n], np.int32))
            positions.append(pos)
            slots.append(self.tables[b][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
            tables.append(self.tables[b][:used])
        width = max(len(t) for t in tables)
        block_tables = np.full((len(tables), width), -1, np.int32)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        return ForwardBatch(token_ids=np.concatenate(ids), positions=np.concatenate(positions),
                            slot_mapping=np.concatenate(slots).astype(np.int32),
                            query_start_loc=np.asarray(starts, np.int32),
                            seq_lens=np.asarray(seq_lens, np.int32), block_tables=block_tables,
                            max_query_len=max(new_counts.values()), max_seq_len=max(seq_lens))

    def advance(self, new_counts: dict, next_tokens=None):
        for row, (b, n) in enumerate(new_counts.items()):
            self.computed[b] += n
            if next_tokens is not None and self.computed[b] == len(self.tokens[b]):
                self.tokens[b].append(int(next_tokens[row]))

    def written_slots(self) -> set:
        return {int(self.tables[b][p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                for b, n in enumerate(self.computed) for p in range(n)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from cupy_llama.models import model_for, read_config
    from cupy_llama.bench.random_model import make_random_model
    from cupy_llama.weights import open_checkpoint
    directory = make_random_model(
        tmp_path_factory.mktemp("graphs") / "model", "tiny", seed=0, hidden_size=512,
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=768, vocab_size=1000,
        tie_word_embeddings=False)
    config = read_config(directory)
    return config, open_checkpoint(directory, model_for(config))


NUM_SEQS = 12
NUM_KV_BLOCKS = NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE


def make_backends(model, enforce_eager=False, switches=None):
    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.backends.cuda.backend import CudaBackend
    from cupy_llama.models import model_for
    config, checkpoint = model
    cpu = CpuBackend(model_for(config), checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                     block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    gpu_backend = CudaBackend(model_for(config), checkpoint, max_model_len=MAX_MODEL_LEN,
                              max_num_seqs=NUM_SEQS, max_num_batched_tokens=256,
                              block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
                              enforce_eager=enforce_eager, switches=switches)
    return cpu, gpu_backend


def prefill(cpu, gpu_backend, config, seqs: Sequences):
    """Every prompt but its last token, in chunks of at most 100 tokens per sequence and two
    sequences per step (the pool holds 256 tokens)."""
    while True:
        counts = {b: min(100, len(t) - 1 - seqs.computed[b]) for b, t in enumerate(seqs.tokens)}
        counts = dict([(b, n) for b, n in counts.items() if n > 0][:2])
        if not counts:
            return
        batch = seqs.batch(counts)
        cpu.forward(batch)
        gpu_backend.forward(batch)
        seqs.advance(counts)


def assert_kv_written_by(gpu_backend, seqs) -> None:
    """Exactly the slots of the sequences' computed tokens hold values: no padding row of a
    graph wrote K/V, and no token's K/V went missing (never-written slots are NaN)."""
    import cupy
    kv = cupy.asnumpy(gpu_backend._kv)  # [L, 2, blocks, block_size, nkv, d]
    touched = (kv != NAN_BITS).any(axis=(0, 1, 4, 5)).reshape(-1)
    expected_touched = np.zeros(touched.shape, bool)
    expected_touched[sorted(seqs.written_slots())] = True
    stray = np.flatnonzero(touched & ~expected_touched)
    assert stray.size == 0, f"{stray.size} KV slots written that belong to no token: {stray[:8]}"
    assert touched[expected_touched].all(), "a token's K/V never reached the cache"


def assert_logits_close(got, expected, tolerance, what):
    scale = float(np.max(np.abs(expected)))
    diff = float(np.max(np.abs(got - expected)))
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    assert diff <= tolerance * scale, f"{what}: max |diff| {diff:.3e} > {tolerance} x {scale:.3e}"


# decode steps: the sequences in each (sizes 1, 3, 5, 1, 3, 5, 11, 9: buckets 1, 4, 8, 1, 4,
# 8, 12, 12 with padding; the first three rounds within 512 tokens, so buckets 1 and 4
# replay their short-context graphs), several steps each so block tables and sequence lengths
# change between replays; the last round's padding rows hold what the round before left in
# its block tables
DECODE_ROUNDS = [[3], [1, 4, 6], [5, 9, 10, 11, 3], [7], [0, 5, 9], [1, 2, 3, 4, 11],
                 list(range(11)), [0, 2, 4, 6, 8, 10, 1, 3, 5]]
STEPS_PER_ROUND = 3


@pytest.mark.parametrize("skinny", ["cublas", "mma"])
@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_graph_decode_matches_eager(model, rng, skinny):
    import cupy
    from cupy_llama.backends.cuda.switches import KernelSwitches
    config = model[0]
    cpu, gpu_backend = make_backends(model, switches=KernelSwitches(skinny_gemm=skinny))
    assert gpu_backend.graphs is not None, f"graphs are off: {gpu_backend.graphs_off_reason}"
    graphs = gpu_backend.graphs
    # with clusters, short-context graphs at buckets 1 to 4 (the CUDA-core kernel's); from
    # 8 sequences the tensor-core kernel's clusters run at every context, in the one graph
    clustered = gpu_backend.ops.clusters
    assert graphs.num_captured == len(graphs.buckets) + (3 if clustered else 0)
    if clustered:
        assert graphs.short_limit == 512  # head_dim 64, 4 query heads per kv head
        assert graphs.limit_for(1, 16) == graphs.limit_for(4, 300) == 512
        assert graphs.limit_for(1, 513) == MAX_MODEL_LEN
        assert graphs.limit_for(8, 300) == graphs.limit_for(12, 16) == MAX_MODEL_LEN
    # long prompts (several attention splits: up to 1000 keys over 4 splits), short ones
    lengths = [900, 37, 600, 16, 17, 300, 1, 700, 64, 250, 129, 5]
    prompts = [rng.integers(0, config.vocab_size, n) for n in lengths]
    seqs = Sequences(prompts, NUM_KV_BLOCKS, rng)
    prefill(cpu, gpu_backend, config, seqs)
    for members in DECODE_ROUNDS:
        for step in range(STEPS_PER_ROUND):
            counts = {b: 1 for b in members}
            batch = seqs.batch(counts)
            what = f"{skinny}: {len(members)} sequences, step {step}"
            expected = cpu.forward(batch)
            replayed = cupy.asnumpy(gpu_backend.forward(batch))
            uncaptured = cupy.asnumpy(gpu_backend.graphs.run_uncaptured(batch))
            np.testing.assert_array_equal(replayed, uncaptured,
                                          err_msg=f"{what}: replay vs the same launches run eagerly")
            eager = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, batch))
            assert_logits_close(replayed, eager, EAGER_TOLERANCE, f"{what}: graph vs eager")
            assert_logits_close(replayed, expected, REFERENCE_TOLERANCE, f"{what}: graph vs CPU")
            seqs.advance(counts, np.argmax(expected, axis=-1))
    # padding rows wrote no KV: exactly the slots of real tokens hold values
    assert_kv_written_by(gpu_backend, seqs)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_step_graphs_match_eager(model, rng):
    """Prefill chunks and steps mixing them with decode tokens replay their bucket's step
    graphs (the pieces between attentions, padded to the bucket) with attention run on the
    step's own sequences: close to the eager pass (other row counts, so other cuBLAS
    algorithms) and to the CPU reference, and the padding rows write no KV."""
    import cupy
    config = model[0]
    cpu, gpu_backend = make_backends(model)
    steps = gpu_backend.step_graphs
    assert steps is not None, f"graphs are off: {gpu_backend.graphs_off_reason}"
    # per bucket: the pieces between attentions, and the whole step of one sequence
    assert steps.num_captured == len(steps.buckets) * (config.num_hidden_layers + 2)
    lengths = [250, 37, 6, 90, 17]
    seqs = Sequences([rng.integers(0, config.vocab_size, n) for n in lengths], NUM_KV_BLOCKS, rng)
    # steps of 3 to 250 tokens (buckets 16 to 256): first chunks, later chunks beside
    # decode tokens, a whole prompt
    rounds = [{0: 120, 1: 20}, {2: 3}, {0: 100, 3: 40, 4: 16}, {1: 16, 2: 2, 3: 49},
              {0: 29, 1: 1, 2: 1, 3: 1, 4: 1}]
    for counts in rounds:
        assert all(seqs.computed[b] + n < len(seqs.tokens[b]) + 1 for b, n in counts.items())
        batch = seqs.batch(counts)
        assert steps.can_run(batch), counts
        expected = cpu.forward(batch)
        replayed = cupy.asnumpy(gpu_backend.forward(batch))
        eager = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, batch))  # rewrites the same KV
        what = f"step of {batch.num_tokens} tokens in {batch.num_seqs} sequences"
        assert_logits_close(replayed, eager, EAGER_TOLERANCE, f"{what}: step graphs vs eager")
        assert_logits_close(replayed, expected, REFERENCE_TOLERANCE, f"{what}: step graphs vs CPU")
        seqs.advance(counts, np.argmax(expected, axis=-1))
    assert_kv_written_by(gpu_backend, seqs)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_one_sequence_steps_replay_one_graph(model, rng):
    """A step of one sequence (a whole prompt, a first chunk, a later chunk after cached
    tokens, in buckets from 16 to 256 tokens) replays its bucket's whole-step graph: no
    attention is launched from Python, the logits match the eager pass and the CPU
    reference, and the padding rows write no KV."""
    import cupy
    config = model[0]
    cpu, gpu_backend = make_backends(model)
    model_object = gpu_backend.model
    launched = []
    eager_attention = model_object.attention
    model_object.attention = lambda *args: (launched.append(args[-1]), eager_attention(*args))
    seqs = Sequences([rng.integers(0, config.vocab_size, n) for n in (250, 200, 9)],
                     NUM_KV_BLOCKS, rng)
    rounds = [{0: 250}, {1: 100}, {1: 60}, {2: 9}, {1: 40}]  # {1: 60}: after 100 cached
    for counts in rounds:
        batch = seqs.batch(counts)
        expected = cpu.forward(batch)
        replayed = cupy.asnumpy(gpu_backend.forward(batch))
        what = f"one sequence, {batch.num_tokens} tokens after {int(batch.seq_lens[0]) - batch.num_tokens}"
        assert launched == [], f"{what}: attention launched from Python, not replayed"
        eager = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, batch))  # rewrites the same KV
        launched.clear()
        assert_logits_close(replayed, eager, EAGER_TOLERANCE, f"{what}: whole-step graph vs eager")
        assert_logits_close(replayed, expected, REFERENCE_TOLERANCE, f"{what}: graph vs CPU")
        seqs.advance(counts, np.argmax(expected, axis=-1))
    assert_kv_written_by(gpu_backend, seqs)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_enforce_eager(model, rng):
    import cupy
    config = model[0]
    cpu, gpu_backend = make_backends(model, enforce_eager=True)
    assert gpu_backend.graphs is None and gpu_backend.graphs_off_reason == "enforce_eager=True"
    assert gpu_backend.step_graphs is None
    seqs = Sequences([rng.integers(0, config.vocab_size, n) for n in (40, 300, 3)], NUM_KV_BLOCKS, rng)
    prefill(cpu, gpu_backend, config, seqs)
    for _ in range(3):
        counts = {0: 1, 1: 1, 2: 1}
        batch = seqs.batch(counts)
        expected = cpu.forward(batch)
        got = cupy.asnumpy(gpu_backend.forward(batch))
        again = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, batch))  # rewrites the same KV
        np.testing.assert_array_equal(got, again, err_msg="enforce_eager: forward is not the eager pass")
        assert_logits_close(got, expected, REFERENCE_TOLERANCE, "enforce_eager vs CPU")
        seqs.advance(counts, np.argmax(expected, axis=-1))




@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_placeholder_tokens_are_read_on_the_device(model, rng):
    """A step launched before the previous step's tokens reach the host names them as
    -(row + 1): graph replay and the eager pass must give exactly the logits of the same
    step with the token ids written out, in a decode step and in a prefill chunk."""
    from dataclasses import replace

    import cupy
    from cupy_llama.interface import SamplingTensors
    config = model[0]
    cpu, gpu_backend = make_backends(model)
    seqs = Sequences([rng.integers(0, config.vocab_size, n) for n in (40, 300, 3, 77)],
                     NUM_KV_BLOCKS, rng)
    prefill(cpu, gpu_backend, config, seqs)
    counts = {b: 1 for b in range(4)}
    greedy = SamplingTensors(temperature=np.zeros(4, np.float32), top_k=np.zeros(4, np.int32),
                             top_p=np.ones(4, np.float32), min_p=np.zeros(4, np.float32),
                             seeds=np.zeros(4, np.uint64), steps=np.zeros(4, np.int32))
    for _ in range(3):
        logits = gpu_backend.forward(seqs.batch(counts))
        sampled = gpu_backend.ops.sample_async(logits, greedy).get()
        seqs.advance(counts, sampled)
        written = seqs.batch(counts)  # the sampled tokens, as the host now knows them
        named = replace(written, token_ids=-np.arange(1, 5, dtype=np.int32))  # rows 0..3
        for run in (gpu_backend.forward, lambda b: gpu_backend.model.forward(gpu_backend, b)):
            expected = cupy.asnumpy(run(written))
            got = cupy.asnumpy(run(named))  # rewrites the same KV slots
            np.testing.assert_array_equal(got, expected, err_msg="placeholders vs written ids")
    # a prefill chunk whose last token is a placeholder (a preempted sequence recomputed)
    logits = gpu_backend.forward(seqs.batch(counts))
    sampled = gpu_backend.ops.sample_async(logits, greedy).get()
    seqs.advance(counts, sampled)
    seqs.computed[1] -= 5  # recompute its last five tokens as one chunk
    chunk = seqs.batch({1: 6})
    ids = chunk.token_ids.copy()
    ids[-1] = -2  # row 1 of the last sampling call
    expected = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, chunk))
    got = cupy.asnumpy(gpu_backend.model.forward(gpu_backend, replace(chunk, token_ids=ids)))
    np.testing.assert_array_equal(got, expected, err_msg="placeholder inside a prefill chunk")


# ------------------------------------------------ attention with device-derived splits

@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 3, 8, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_graph_attention_with_padding(rng, num_splits, head_dim):
    """max_seq_len=None: split lengths come from seq_lens on the device; padding rows
    (sequence length 0) come out as zeros, not NaN."""
    import cupy as cp
    from test_cuda_ops import DECODE, assert_close, build_attention_case, poisoned, random_bf16, to_float
    from cupy_llama.backends.cuda import attention
    num_pad, group = 3, 4
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    batch, num_heads = case["gpu_batch"], case["num_heads"]
    num_seqs = batch.num_seqs + num_pad
    pad_q = random_bf16(rng, (num_pad, num_heads, head_dim))[0]
    q = np.concatenate([case["q_bits"], pad_q])
    seq_lens = np.concatenate([batch.seq_lens, np.zeros(num_pad, np.int32)])
    query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
    tables = np.concatenate([batch.block_tables, np.full((num_pad, case["width"]), -1, np.int32)])
    out = poisoned(cp, (num_seqs, num_heads * head_dim))
    partial_out = poisoned(cp, num_seqs * num_heads * num_splits * head_dim, np.float32)
    partial_lse = poisoned(cp, num_seqs * num_heads * num_splits, np.float32)
    attention.paged_attention(
        cp.asarray(q), case["k_gpu"], case["v_gpu"], cp.asarray(tables), cp.asarray(seq_lens),
        cp.asarray(query_start_loc), out, scale=head_dim ** -0.5, max_query_len=1,
        max_seq_len=None, num_splits=num_splits, partial_out=partial_out, partial_lse=partial_lse)
    got = to_float(cp, out)
    assert_close(got[:batch.num_seqs], case["expected"], 1.5e-2, 1e-2,
                 f"device-derived splits ({num_splits}), d={head_dim}")
    assert (got[batch.num_seqs:] == 0).all(), "padding rows must come out as zeros"


# ------------------------------------------------------------ custom skinny GEMM kernels

REAL_SHAPES = [(2048, 3072, np.uint16), (2048, 2048, np.uint16), (2048, 16384, np.uint16),
               (8192, 2048, np.uint16), (2048, 128256, np.float32), (192, 1001, np.uint16)]


def _weight(k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    bits = float32_to_bf16_bits(rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))
    return bits, bf16_bits_to_float32(bits)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("k,n,out_dtype", REAL_SHAPES)
def test_gemv_against_numpy(rng, k, n, out_dtype):
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    w_bits, w = _weight(k, n, int(rng.integers(0, 2 ** 31)))
    w_dev = cp.asarray(w_bits)
    for m in (1, 3, 8, 16):
        x_bits = float32_to_bf16_bits(rng.standard_normal((m, k), dtype=np.float32))
        x = bf16_bits_to_float32(x_bits)
        expected = (x @ w.T).astype(np.float64)
        out = cp.full((m, n), NAN_BITS if out_dtype == np.uint16 else np.nan, dtype=out_dtype)
        gemm.gemv(cp.asarray(x_bits), w_dev, out)
        host = cp.asnumpy(out)
        got = (bf16_bits_to_float32(host) if out_dtype == np.uint16 else host).astype(np.float64)
        assert not np.isnan(got).any(), f"gemv [{m},{k}]x[{n},{k}]^T left NaN in the output"
        rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert rel < 1e-2, f"gemv [{m},{k}]x[{n},{k}]^T: relative Frobenius error {rel:.3g}"


# ------------------------------------------------------ tensor-core skinny kernel (mma)

MMA_ROWS = (1, 2, 3, 4, 8, 16)
# (K, N): K not a multiple of 64 (a partial last k step), N not a multiple of 16 (a partial
# last tile), tiny shapes where most warps of a block own no k step
ODD_SHAPES = [(200, 1001), (8, 17), (72, 5), (1000, 33), (4104, 31), (64, 16)]


def _x(rng, m: int, k: int):
    bits = float32_to_bf16_bits(rng.standard_normal((m, k), dtype=np.float32))
    return bits, bf16_bits_to_float32(bits)


def _run_product(cp, fn, x_bits, w_dev, n, out_dtype):
    """fn(x, w, out) into a NaN-poisoned output; the result as float64 on the host."""
    m = x_bits.shape[0]
    out = cp.full((m, n), NAN_BITS if out_dtype == np.uint16 else np.nan, dtype=out_dtype)
    fn(cp.asarray(x_bits), w_dev, out)
    host = cp.asnumpy(out)
    return (bf16_bits_to_float32(host) if out_dtype == np.uint16 else host).astype(np.float64)


def _assert_product(got, expected, what):
    assert not np.isnan(got).any(), f"{what}: NaN left in the output"
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < 1e-2, f"{what}: relative Frobenius error {rel:.3g}"


def _mma_or_linear(cp, x_bits, w_dev, n, out_dtype, what):
    """The mma kernel where it takes the product; where it refuses (shared memory), the
    refusal is a clear ValueError and linear() under the "mma" switch still computes it."""
    from cupy_llama.backends.cuda import gemm
    x_dev = cp.asarray(x_bits)
    reason = gemm.mma_unsupported(x_dev, w_dev)
    if reason is None:
        return _run_product(cp, gemm.mma, x_bits, w_dev, n, out_dtype)
    assert "shared memory" in reason, f"{what}: unexpected refusal: {reason}"
    out = cp.empty((x_bits.shape[0], n), out_dtype)
    with pytest.raises(ValueError, match="cuBLAS"):
        gemm.mma(x_dev, w_dev, out)
    return _run_product(cp, gemm.Products("mma").linear, x_bits, w_dev, n, out_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("k,n,_", REAL_SHAPES)
def test_mma_against_numpy(rng, k, n, _):
    import cupy as cp
    w_bits, w = _weight(k, n, int(rng.integers(0, 2 ** 31)))
    w_dev = cp.asarray(w_bits)
    for m in MMA_ROWS:
        x_bits, x = _x(rng, m, k)
        expected = (x @ w.T).astype(np.float64)
        for out_dtype in (np.uint16, np.float32):
            what = f"mma [{m},{k}]x[{n},{k}]^T -> {np.dtype(out_dtype).name}"
            _assert_product(_mma_or_linear(cp, x_bits, w_dev, n, out_dtype, what), expected, what)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("k,n", ODD_SHAPES)
def test_mma_odd_shapes(rng, k, n):
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    w_bits, w = _weight(k, n, int(rng.integers(0, 2 ** 31)))
    w_dev = cp.asarray(w_bits)
    for m in range(1, gemm.SKINNY_MAX_ROWS + 1):
        x_bits, x = _x(rng, m, k)
        expected = (x @ w.T).astype(np.float64)
        for out_dtype in (np.uint16, np.float32):
            what = f"mma [{m},{k}]x[{n},{k}]^T -> {np.dtype(out_dtype).name}"
            _assert_product(_run_product(cp, gemm.mma, x_bits, w_dev, n, out_dtype), expected, what)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_mma_writes_only_its_output(rng):
    """Rows past M and columns past N of the last tile are never stored: the output is a
    view into a larger poisoned buffer whose tail must come back untouched."""
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    k, n, m = 256, 37, 5
    w_bits, w = _weight(k, n, int(rng.integers(0, 2 ** 31)))
    x_bits, x = _x(rng, m, k)
    buffer = cp.full(m * n + 4096, -7.0, np.float32)
    out = buffer[:m * n].reshape(m, n)
    gemm.mma(cp.asarray(x_bits), cp.asarray(w_bits), out)
    assert (cp.asnumpy(buffer[m * n:]) == -7.0).all(), "mma wrote past its output"
    _assert_product(cp.asnumpy(out).astype(np.float64), x @ w.T, "mma into a view")


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_mma_refuses_what_it_cannot_take_and_linear_falls_back(rng):
    """K % 8 != 0 and x rows not 16-byte aligned: mma raises a one-line ValueError, linear
    under the "mma" switch computes the product with cuBLAS."""
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    products = gemm.Products("mma")
    for k, n, m, offset in ((1001, 64, 3, 0), (256, 48, 2, 1)):
        w_bits, w = _weight(k, n, int(rng.integers(0, 2 ** 31)))
        x_bits, x = _x(rng, m, k)
        flat = cp.zeros(m * k + offset, np.uint16)
        flat[offset:] = cp.asarray(x_bits.reshape(-1))
        x_dev = flat[offset:].reshape(m, k)  # offset 1: 2-byte aligned rows
        w_dev = cp.asarray(w_bits)
        out = cp.full((m, n), NAN_BITS, np.uint16)
        with pytest.raises(ValueError, match="skinny mma: needs"):
            gemm.mma(x_dev, w_dev, out)
        products.linear(x_dev, w_dev, out)
        got = bf16_bits_to_float32(cp.asnumpy(out)).astype(np.float64)
        _assert_product(got, x @ w.T, f"linear fallback K={k} offset={offset}")


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_mma_replays_from_a_graph_bit_identically(rng):
    """The kernel allocates nothing and never synchronizes: it captures, and the replay
    equals the eager launch bit for bit (deterministic sums)."""
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    k, n, m = 2048, 3072, 4
    w_dev = cp.asarray(_weight(k, n, int(rng.integers(0, 2 ** 31)))[0])
    x_dev = cp.asarray(_x(rng, m, k)[0])
    eager = cp.empty((m, n), np.uint16)
    replayed = cp.full((m, n), NAN_BITS, np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gemm.mma(x_dev, w_dev, eager)  # compiles and sets kernel attributes outside the capture
        stream.begin_capture()
        gemm.mma(x_dev, w_dev, replayed)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(replayed), cp.asnumpy(eager))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("kernel", ["mma", "gemv", "cublas"])
def test_linear_auto_follows_the_choice_table(rng, kernel):
    """Under "auto", linear runs the kernel the table names for (N, K, M): its output equals
    that kernel's, bit for bit."""
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    k, n, m = 512, 96, 3
    w_dev = cp.asarray(_weight(k, n, int(rng.integers(0, 2 ** 31)))[0])
    x_dev = cp.asarray(_x(rng, m, k)[0])
    direct = cp.empty((m, n), np.float32)
    {"mma": gemm.mma, "gemv": gemm.gemv, "cublas": gemm.cublas_linear}[kernel](x_dev, w_dev, direct)
    routed = cp.full((m, n), np.nan, np.float32)
    gemm.Products("auto", table={(n, k): {m: kernel}}).linear(x_dev, w_dev, routed)
    np.testing.assert_array_equal(cp.asnumpy(routed), cp.asnumpy(direct))


# ------------------------------------------- choosing the kernel (no GPU needed)

def test_choose_follows_the_switch_then_the_table_then_the_rule():
    from cupy_llama.backends.cuda import gemm
    table = {(3072, 2048): {1: "gemv", 8: "cublas", 16: "mma"}}
    assert gemm.choose("cublas", 3072, 2048, 1, table) == "cublas"
    assert gemm.choose("mma", 3072, 2048, 8, table) == "mma"
    assert gemm.choose("auto", 3072, 2048, 1, table) == "gemv"
    assert gemm.choose("auto", 3072, 2048, 8, table) == "cublas"
    assert gemm.choose("auto", 3072, 2048, 16, table) == "mma"
    # shapes or row counts the table does not list: mma up to 4 rows, cuBLAS above
    assert gemm.choose("auto", 3072, 2048, 3, table) == "mma"
    assert gemm.choose("auto", 2048, 2048, 4, table) == "mma"
    assert gemm.choose("auto", 2048, 2048, 5, table) == "cublas"
    assert gemm.choose("auto", 2048, 2048, 1, {}) == "mma"
    # accumulating products: the skinny kernel under "auto" whatever the table says (it
    # times plain products), never the SIMT gemv kernel (it cannot add to its output)
    assert gemm.choose("auto", 3072, 2048, 8, table, accumulate=True) == "mma"
    assert gemm.choose("auto", 3072, 2048, 1, table, accumulate=True) == "mma"
    assert gemm.choose("auto", 3072, 2048, 17, table, accumulate=True) == "cublas"
    assert gemm.choose("cublas", 3072, 2048, 8, table, accumulate=True) == "cublas"
    assert gemm.choose("mma", 3072, 2048, 8, table, accumulate=True) == "mma"
    # past 16 rows it is always cuBLAS, whatever the switch
    for switch in ("auto", "mma"):
        assert gemm.choose(switch, 3072, 2048, 17, table) == "cublas"


def test_normed_products_fuse_up_to_a_size_of_x():
    """Under "auto" the normed sublayer products take their fused skinny kernel while x holds
    at most FUSED_NORM_MAX_X elements (Llama-3.2-1B's 13 rows of 2,048; every row count of
    Qwen3-0.6B's 1,024), then compose; "mma" always fuses, "cublas" never, and FP8
    weights (which only the skinny kernels read as they are) always."""
    from cupy_llama.backends.cuda import gemm
    from cupy_llama.interface import Fp8Weight
    bf16 = object()
    fp8 = Fp8Weight(data=None, scale=None)
    auto, mma, cublas = gemm.Products("auto"), gemm.Products("mma"), gemm.Products("cublas")
    limit = gemm.FUSED_NORM_MAX_X
    assert limit == 13 * 2048
    assert auto.fuses_norm(13, 2048, bf16) and not auto.fuses_norm(14, 2048, bf16)
    assert auto.fuses_norm(gemm.SKINNY_MAX_ROWS, 1024, bf16)
    assert auto.fuses_norm(1, limit, bf16) and not auto.fuses_norm(1, limit + 8, bf16)
    assert auto.fuses_norm(16, 2048, fp8)
    assert mma.fuses_norm(16, 2048, bf16) and mma.fuses_norm(16, 2048, fp8)
    assert not cublas.fuses_norm(1, 2048, bf16)


def test_products_reject_unknown_switches():
    from cupy_llama.backends.cuda import gemm
    with pytest.raises(ValueError, match="skinny must be one of"):
        gemm.Products("gemv")


def test_choice_table_files(tmp_path):
    from cupy_llama.backends.cuda import gemm
    (tmp_path / "gemm_choice_a100.json").write_text(
        '{"gpu": "NVIDIA A100", "choices": {"2048x2048": {"1": "cublas"}}}')
    (tmp_path / "gemm_choice_h200.json").write_text(
        '{"gpu": "NVIDIA H200", "choices": {"2048x2048": {"1": "mma", "2": "gemv"}, '
        '"128256x2048": {"16": "cublas"}}}')
    table = gemm.load_choice_table("NVIDIA H200", tmp_path)
    assert table == {(2048, 2048): {1: "mma", 2: "gemv"}, (128256, 2048): {16: "cublas"}}
    assert gemm.load_choice_table("NVIDIA B200", tmp_path) == {}
    with pytest.raises(ValueError, match="kernels one of"):
        gemm.parse_choice_table({"choices": {"2048x2048": {"1": "fast"}}})
    with pytest.raises(ValueError, match="shape keys"):
        gemm.parse_choice_table({"choices": {"2048-2048": {"1": "mma"}}})


def test_committed_choice_tables_parse():
    from cupy_llama.backends.cuda import gemm
    for path in sorted(gemm.CHOICE_DIR.glob("gemm_choice_*.json")):
        import json
        data = json.loads(path.read_text())
        assert data.get("gpu"), f"{path.name}: no gpu name"
        gemm.parse_choice_table(data, path.name)


def test_perf_choice_table_round_trip():
    """perf's measured rows -> the JSON it writes -> the table gemm reads: the fastest
    kernel per shape and row count."""
    from conftest import script_module
    from cupy_llama.backends.cuda import gemm
    perf = script_module("perf")
    rows = [{"weight": "qkv", "n": 3072, "k": 2048, "m": 1, "cublas_us": 9.0, "gemv_us": 7.0,
             "mma_us": 4.0, "best": "mma"},
            {"weight": "qkv", "n": 3072, "k": 2048, "m": 16, "cublas_us": 5.0, "gemv_us": 30.0,
             "mma_us": float("nan"), "best": "cublas"}]
    data = perf.choice_table("NVIDIA H200", rows)
    assert data["us_per_call"]["3072x2048"]["16"]["mma"] is None
    assert gemm.parse_choice_table(data) == {(3072, 2048): {1: "mma", 16: "cublas"}}
    assert perf.choice_file_name("NVIDIA H200") == "gemm_choice_h200.json"
    assert perf.choice_file_name("NVIDIA H100 80GB HBM3") == "gemm_choice_h100_80gb_hbm3.json"


def test_perf_merges_a_models_shapes_into_the_gpus_table(tmp_path):
    """--tune --merge: the shapes of the table beside gemm.py that the model lacks stay, a
    shape both hold takes the new timing, another GPU's file is not mixed in."""
    import json

    from conftest import script_module
    from cupy_llama.backends.cuda import gemm
    perf = script_module("perf")
    old = {"gpu": "NVIDIA H200", "measured_by": "x",
           "choices": {"3072x2048": {"1": "gemv"}, "4096x1024": {"1": "cublas"}},
           "us_per_call": {"3072x2048": {"1": {"gemv": 5.0}}, "4096x1024": {"1": {"cublas": 9.0}}}}
    (tmp_path / "gemm_choice_h200.json").write_text(json.dumps(old))
    new = perf.choice_table("NVIDIA H200", [
        {"weight": "qkv", "n": 4096, "k": 1024, "m": 1, "cublas_us": 9.0, "gemv_us": 7.0,
         "mma_us": 4.0, "best": "mma"}])
    merged = perf.merged_table(new, tmp_path)
    assert gemm.parse_choice_table(merged) == {(3072, 2048): {1: "gemv"}, (4096, 1024): {1: "mma"}}
    assert merged["us_per_call"]["3072x2048"] == {"1": {"gemv": 5.0}}
    assert merged["measured_by"] == perf.MERGED_BY
    other = perf.choice_table("NVIDIA H100 80GB HBM3", [])
    assert perf.merged_table(other, tmp_path) == other  # no file for that GPU


H200_LIMITS = {"sms": 132, "max_shared_per_block": 232448, "shared_per_sm": 233472,
               "regs_per_sm": 65536, "threads_per_sm": 2048}


def test_mma_shared_memory_and_residency():
    from cupy_llama.backends.cuda import gemm
    # staged x rows: a multiple of 64 bf16 plus the pad, so the row stride is 64 mod 128
    # bytes (the fragment reads of one quarter warp hit 32 distinct banks)
    for m, k in ((2, 2048), (3, 200), (8, 8192), (16, 8)):  # m - 1 rows use as many x tiles
        per_row = gemm.mma_shared_bytes(m, k) - gemm.mma_shared_bytes(m - 1, k)
        assert per_row % 128 == 64 and per_row >= 2 * k, (m, k, per_row)
    # the decode shapes fit a block on an H200, except 16 rows of the 8192-wide down_proj
    for m in (1, 8, 16):
        assert gemm.mma_shared_bytes(m, 2048) <= H200_LIMITS["max_shared_per_block"]
    assert gemm.mma_shared_bytes(8, 8192) <= H200_LIMITS["max_shared_per_block"]
    assert gemm.mma_shared_bytes(16, 8192) > H200_LIMITS["max_shared_per_block"]
    # two blocks of 256 threads per SM at <= 128 registers, one when x fills shared memory
    # (static shared memory: the norm prologue's row sums, at most 1,088 bytes)
    static = 1088
    assert gemm.mma_blocks_per_sm(96, gemm.mma_shared_bytes(1, 2048), static, H200_LIMITS) == 2
    assert gemm.mma_blocks_per_sm(128, gemm.mma_shared_bytes(16, 2048), static, H200_LIMITS) == 2
    assert gemm.mma_blocks_per_sm(104, gemm.mma_shared_bytes(8, 8192), static, H200_LIMITS) == 1
    assert gemm.mma_blocks_per_sm(200, 1024, static, H200_LIMITS) == 1


NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_mma_kernels_compile_without_spills(tmp_path, arch):
    """Every skinny kernel (plain and fused, both variants) exists, fits the 2-blocks-per-SM
    register budget and keeps its per-row registers in registers (no stack frame, no
    spills)."""
    from cupy_llama.backends.cuda import gemm
    from cupy_llama.backends.cuda.kernels import kernel_dir
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", f"-I{kernel_dir()}", "-cubin",
                             "-Xptxas", "-v", "-o", str(tmp_path / "gemv.cubin"),
                             str(kernel_dir() / "gemv.cu")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = result.stderr + result.stdout
    for kernel in gemm.SKINNY_KERNELS.values():
        match = re.search(rf"Function properties for {kernel}\s*\n\s*(\d+) bytes stack frame, "
                          rf"(\d+) bytes spill stores, (\d+) bytes spill loads.*?\n.*?Used "
                          rf"(\d+) registers", report)
        assert match, f"{kernel} missing from the ptxas report:\n{report}"
        stack, stores, loads, registers = map(int, match.groups())
        assert stack == stores == loads == 0, f"{kernel} ({arch}): stack/spills {match.groups()}"
        assert registers <= 65536 // (2 * gemm.MMA_WARPS * 32), f"{kernel} ({arch}): {registers} registers"
