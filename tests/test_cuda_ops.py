"""CUDA kernels against the float32 NumPy reference ops, on the same bf16-rounded inputs.

Fresh random inputs every run (the seed is printed; a failure shows it), outputs poisoned
with NaN before each launch, never-written KV slots NaN so stray reads show. Tolerances
are docs/ARCHITECTURE.md's "Correctness bars". Needs CuPy and a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cupy_llama.backends.cuda import attention as attention_kernels
from cupy_llama.backends.numpy_ops import NumpyOps, filtered_probs
from cupy_llama.interface import ForwardBatch, SamplingTensors
from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from cupy_llama.util import cdiv


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]

NAN_BITS = 0x7FC0
NUM_POOL_BLOCKS = 32768
BLOCK_SIZE = 16
REF = NumpyOps()


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


# ------------------------------------------------------------------------------ helpers

def random_bf16(rng, shape, scale=1.0):
    """(bf16 bits, the same values as float32)."""
    bits = float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return bits, bf16_bits_to_float32(bits)


def poisoned(cp, shape, dtype=np.uint16):
    if np.dtype(dtype) == np.uint16:
        return cp.full(shape, NAN_BITS, dtype=np.uint16)
    return cp.full(shape, np.nan, dtype=dtype)


def to_float(cp, array) -> np.ndarray:
    host = cp.asnumpy(array)
    return bf16_bits_to_float32(host) if host.dtype == np.uint16 else host


def assert_close(actual, expected, atol, rtol, what):
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    nan = np.isnan(actual) & ~np.isnan(expected)
    err = np.abs(actual - expected)
    bad = ~(err <= atol + rtol * np.abs(expected)) | nan
    if bad.any():
        where = np.argwhere(bad)
        first = tuple(where[0])
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements out of tolerance (atol {atol}, rtol "
            f"{rtol}); NaN where the reference is finite: {nan.sum()}; max abs error "
            f"{np.nanmax(np.where(np.isnan(err), 0, err)):.3g}; first bad index {first}: got "
            f"{actual[first]!r}, expected {expected[first]!r}")


def rope_table(max_pos, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    angles = np.outer(np.arange(max_pos, dtype=np.float32), inv_freq.astype(np.float32))
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def make_ops(max_num_tokens, max_num_seqs, max_blocks_per_seq, num_heads, head_dim, max_model_len):
    from cupy_llama.backends.cuda.ops import CudaOps
    return CudaOps(max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                   max_blocks_per_seq=max_blocks_per_seq, num_heads=num_heads,
                   head_dim=head_dim, max_model_len=max_model_len)


# ---------------------------------------------------------------------- row-wise ops

@pytest.mark.parametrize("num_tokens", [1, 17, 129])
def test_embedding_and_gather_rows(cp, rng, num_tokens):
    from cupy_llama.backends.cuda import elementwise
    vocab, hidden = 1000, 576
    table_bits, table = random_bf16(rng, (vocab, hidden))
    ids = rng.integers(0, vocab, num_tokens).astype(np.int32)
    out = poisoned(cp, (num_tokens, hidden))
    elementwise.embedding(cp.asarray(ids), cp.asarray(table_bits), out)
    np.testing.assert_array_equal(cp.asnumpy(out), table_bits[ids], err_msg="embedding rows")

    indices = rng.integers(0, num_tokens, 5).astype(np.int32)
    for dtype in (np.uint16, np.float32):
        x = cp.asarray(table_bits[ids] if dtype == np.uint16 else table[ids])
        gathered = poisoned(cp, (5, hidden), dtype)
        elementwise.gather_rows(x, cp.asarray(indices), gathered)
        np.testing.assert_array_equal(cp.asnumpy(gathered), cp.asnumpy(x)[indices],
                                      err_msg=f"gather_rows {np.dtype(dtype).name}")


@pytest.mark.parametrize("out_dtype", [np.uint16, np.float32])
def test_embedding_reads_placeholders_from_the_pending_tokens(cp, rng, out_dtype):
    """An id -(r + 1) names pending_tokens[r] (a token sampled on the device, not yet on the
    host); past the pending rows, or past the vocabulary, the row is NaN."""
    from cupy_llama.backends.cuda import elementwise
    vocab, hidden, num_pending = 1000, 576, 8
    table_bits, table = random_bf16(rng, (vocab, hidden))
    pending = rng.integers(0, vocab, num_pending).astype(np.int32)
    ids = rng.integers(0, vocab, 40).astype(np.int32)
    rows = rng.integers(0, num_pending, 40)
    named = rng.random(40) < 0.5
    ids[named] = -(rows[named] + 1)
    ids[0], ids[1] = -(num_pending + 1), vocab  # a row that is not pending; an id too large
    out = poisoned(cp, (40, hidden), out_dtype)
    elementwise.embedding(cp.asarray(ids), cp.asarray(table_bits), out,
                          pending_tokens=cp.asarray(pending))
    got = to_float(cp, out)
    resolved = np.where(ids < 0, pending[np.clip(-ids - 1, 0, num_pending - 1)], ids)
    assert np.isnan(got[:2]).all(), "bad ids must give NaN rows"
    np.testing.assert_array_equal(got[2:], table[resolved[2:]])


@pytest.mark.parametrize("x_dtype", ["bf16", "float32"])  # float32: the residual stream
@pytest.mark.parametrize("hidden", [64, 576, 2048, 8192, 90])  # 90: hidden % 4 != 0
@pytest.mark.parametrize("num_tokens", [1, 17, 129])
def test_rms_norm(cp, rng, num_tokens, hidden, x_dtype):
    from cupy_llama.backends.cuda import elementwise
    x_bits, x = random_bf16(rng, (num_tokens, hidden), scale=3.0)
    if x_dtype == "float32":  # values bf16 cannot hold, passed as they are
        x = x_bits = rng.standard_normal((num_tokens, hidden), dtype=np.float32) * 3
    w_bits, w = random_bf16(rng, (hidden,))
    expected = np.empty_like(x)
    REF.rms_norm(x, w, 1e-5, expected)
    out = poisoned(cp, x.shape)
    elementwise.rms_norm(cp.asarray(x_bits), cp.asarray(w_bits), 1e-5, out)
    assert_close(to_float(cp, out), expected, 1e-2, 1e-2, f"rms_norm ({x_dtype} input)")
    if x_dtype == "bf16":  # out aliasing x (a float32 x cannot share a bf16 out)
        in_place = cp.asarray(x_bits)
        elementwise.rms_norm(in_place, cp.asarray(w_bits), 1e-5, in_place)
        assert_close(to_float(cp, in_place), expected, 1e-2, 1e-2, "rms_norm in place")


@pytest.mark.parametrize("shape", [(1, 64), (17, 1536), (129, 8192), (5, 100)])  # last: I % 8 != 0
def test_silu_and_mul(cp, rng, shape):
    from cupy_llama.backends.cuda import elementwise
    bits, values = random_bf16(rng, (shape[0], 2 * shape[1]), scale=2.0)
    expected = np.empty(shape, np.float32)
    REF.act_and_mul(values, expected)
    out = poisoned(cp, shape)
    elementwise.act_and_mul(cp.asarray(bits), out)
    assert_close(to_float(cp, out), expected, 1e-3, 1.6e-2, "silu_and_mul")


@pytest.mark.parametrize("out_dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (17, 2048, 3072), (129, 576, 49152), (300, 8192, 2048)])
def test_linear(cp, rng, m, k, n, out_dtype):
    from cupy_llama.backends.cuda import gemm
    x_bits, x = random_bf16(rng, (m, k))
    w_bits, w = random_bf16(rng, (n, k), scale=0.02)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    out = poisoned(cp, (m, n), out_dtype)
    gemm.Products().linear(cp.asarray(x_bits), cp.asarray(w_bits), out)
    got = to_float(cp, out).astype(np.float64)
    assert not np.isnan(got).any(), "linear left NaN in the output"
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < 1e-2, f"linear [{m},{k}]x[{n},{k}]^T: relative Frobenius error {rel:.3g}"


# ------------------------------------------------------------------------ RoPE + cache

@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 36])  # 36: the path of head_dim % 8 != 0
def test_rope_and_cache(cp, rng, head_dim, group):
    from cupy_llama.backends.cuda import elementwise
    num_kv_heads, num_tokens, num_blocks = 2, 129, 64
    num_heads = num_kv_heads * group
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv_bits, qkv = random_bf16(rng, (num_tokens, width), scale=2.0)
    positions = rng.integers(0, 8192, num_tokens).astype(np.int32)
    slots = rng.choice(num_blocks * BLOCK_SIZE, num_tokens, replace=False).astype(np.int32)
    slots[rng.random(num_tokens) < 0.1] = -1  # padding tokens: not written
    cos_sin = rope_table(8192, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    class Meta:  # what rope_and_cache reads from the step metadata
        def __init__(self, keep):
            self.positions, self.slot_mapping = positions[keep], slots[keep]

    written = slots >= 0
    everything = np.ones(num_tokens, bool)
    q_ref = np.empty((num_tokens, num_heads, head_dim), np.float32)
    scratch = np.empty(cache_shape, np.float32)
    REF.rope_and_cache(qkv, Meta(everything), cos_sin, scratch, scratch.copy(), q_ref)
    # caches: only tokens with a slot are written, every other slot stays NaN
    k_ref = np.full(cache_shape, np.nan, np.float32)
    v_ref = np.full(cache_shape, np.nan, np.float32)
    q_scratch = np.empty((int(written.sum()), num_heads, head_dim), np.float32)
    REF.rope_and_cache(qkv[written], Meta(written), cos_sin, k_ref, v_ref, q_scratch)

    k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
    q_out = poisoned(cp, (num_tokens, num_heads, head_dim))
    elementwise.rope_and_cache(cp.asarray(qkv_bits), cp.asarray(positions), cp.asarray(slots),
                               cp.asarray(cos_sin), k_cache, v_cache, q_out)
    assert_close(to_float(cp, q_out), q_ref, 1e-3, 1.6e-2, "rotated q")
    for name, got, ref in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
        got_bits = cp.asnumpy(got)
        ref_bits = float32_to_bf16_bits(ref)  # NaN stays 0x7FC0: untouched slots must stay NaN
        mismatch = got_bits != ref_bits
        assert not mismatch.any(), (
            f"{name} cache: {mismatch.sum()} elements differ from the reference rounded to bf16 "
            f"(first at {tuple(np.argwhere(mismatch)[0])})")


# --------------------------------------------------- the row kernels' vector paths

def _off_boundary(cp, host):
    """A device copy of `host` that starts one element past a 16-byte boundary."""
    flat = cp.empty(host.size + 16 // host.itemsize, host.dtype)
    view = flat[1:1 + host.size].reshape(host.shape)
    view[...] = cp.asarray(host)
    return view


# where each row kernel takes its vector flag (its signature in cuda_src/)
VECTOR_ARGUMENT = {"rms_norm_kernel": -1, "rms_norm_f32_kernel": -1, "act_and_mul_kernel": 3,
                   "rope_and_cache_kernel": 10}


def test_row_kernels_vector_paths_run_when_aligned_and_agree_off_them(cp, rng, monkeypatch):
    """rms_norm, silu_and_mul and rope_and_cache take their vector paths for aligned
    operands of dividing sizes; an operand off a 16-byte boundary takes the element path,
    which gives the same outputs (the same bits for silu and rope, whose per-element math
    is the same; rms_norm sums its squares in another order)."""
    from cupy_llama.backends.cuda import elementwise
    vector_flags = []
    real_get_kernel = elementwise.get_kernel

    def recording(module, name):
        kernel = real_get_kernel(module, name)

        def launch(grid, block, args):  # the flag: each kernel's argument named vector
            vector_flags.append(int(args[VECTOR_ARGUMENT[name]]))
            return kernel(grid, block, args)
        return launch

    monkeypatch.setattr(elementwise, "get_kernel", recording)

    x = rng.standard_normal((33, 2048), dtype=np.float32)
    w_bits, _ = random_bf16(rng, (2048,))
    outs = [poisoned(cp, x.shape), poisoned(cp, x.shape)]
    elementwise.rms_norm(cp.asarray(x), cp.asarray(w_bits), 1e-5, outs[0])
    elementwise.rms_norm(_off_boundary(cp, x), cp.asarray(w_bits), 1e-5, outs[1])
    assert_close(to_float(cp, outs[1]), to_float(cp, outs[0]), 1e-2, 1e-2, "rms_norm paths")

    gate_up, _ = random_bf16(rng, (33, 2 * 1536), scale=2.0)
    outs = [poisoned(cp, (33, 1536)), poisoned(cp, (33, 1536))]
    elementwise.act_and_mul(cp.asarray(gate_up), outs[0])
    elementwise.act_and_mul(_off_boundary(cp, gate_up), outs[1])
    assert (cp.asnumpy(outs[0]) == cp.asnumpy(outs[1])).all(), "silu_and_mul paths differ"

    heads, kv_heads, head_dim, tokens, blocks = 8, 2, 64, 33, 8
    qkv, _ = random_bf16(rng, (tokens, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    positions = cp.asarray(rng.integers(0, 4096, tokens).astype(np.int32))
    slots = rng.choice(blocks * BLOCK_SIZE, tokens, replace=False).astype(np.int32)
    slots[::5] = -1  # padding tokens write no K/V
    cos_sin = cp.asarray(rope_table(4096, head_dim))
    results = []
    for operand in (cp.asarray(qkv), _off_boundary(cp, qkv)):
        cache_shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
        k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
        q_out = poisoned(cp, (tokens, heads, head_dim))
        elementwise.rope_and_cache(operand, positions, cp.asarray(slots), cos_sin, k_cache,
                                   v_cache, q_out)
        results.append([cp.asnumpy(a) for a in (q_out, k_cache, v_cache)])
    for name, aligned, off in zip(("q", "k cache", "v cache"), *results):
        assert np.array_equal(aligned, off), f"rope_and_cache paths differ in {name}"  # bits

    assert vector_flags == [1, 0, 1, 0, 1, 0]


# ------------------------------------------------------------------------- attention

def build_attention_case(cp, rng, seqs, num_kv_heads, head_dim, group, block_size=BLOCK_SIZE,
                         q_scale=1.0, window=None, softcap=None):
    """seqs: [(cached prefix length, new tokens)]. Returns host reference inputs and the GPU
    caches: the GPU blocks are scattered over a pool of NUM_POOL_BLOCKS, the reference uses
    a compact copy holding only the used blocks. window, softcap: the reference's (the
    runs below take them from the case)."""
    num_heads = num_kv_heads * group
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    num_new = np.array([n for _, n in seqs], np.int32)
    blocks_per_seq = cdiv(seq_lens, block_size)
    total_blocks = int(blocks_per_seq.sum())
    width = int(blocks_per_seq.max())
    pool_ids = rng.choice(NUM_POOL_BLOCKS, total_blocks, replace=False).astype(np.int32)
    compact_tables = np.full((len(seqs), width), -1, np.int32)
    gpu_tables = np.full((len(seqs), width), -1, np.int32)
    shape = (total_blocks, block_size, num_kv_heads, head_dim)
    k_host = np.full(shape, np.nan, np.float32)
    v_host = np.full(shape, np.nan, np.float32)
    next_block = 0
    for b, seq_len in enumerate(seq_lens):
        n = int(blocks_per_seq[b])
        compact_tables[b, :n] = np.arange(next_block, next_block + n)
        gpu_tables[b, :n] = pool_ids[next_block:next_block + n]
        positions = np.arange(seq_len)
        blocks = compact_tables[b][positions // block_size]
        k_host[blocks, positions % block_size] = random_bf16(rng, (seq_len, num_kv_heads, head_dim))[1]
        v_host[blocks, positions % block_size] = random_bf16(rng, (seq_len, num_kv_heads, head_dim))[1]
        next_block += n
    pool_shape = (NUM_POOL_BLOCKS, block_size, num_kv_heads, head_dim)
    k_gpu, v_gpu = poisoned(cp, pool_shape), poisoned(cp, pool_shape)
    ids = cp.asarray(pool_ids)
    k_gpu[ids] = cp.asarray(float32_to_bf16_bits(k_host))
    v_gpu[ids] = cp.asarray(float32_to_bf16_bits(v_host))
    query_start_loc = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    q_bits, q = random_bf16(rng, (num_tokens, num_heads, head_dim), scale=q_scale)
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, num_new)]).astype(np.int32)

    def batch(tables):
        return ForwardBatch(token_ids=np.zeros(num_tokens, np.int32), positions=positions,
                            slot_mapping=np.full(num_tokens, -1, np.int32),
                            query_start_loc=query_start_loc, seq_lens=seq_lens,
                            block_tables=tables, max_query_len=int(num_new.max()),
                            max_seq_len=int(seq_lens.max()))

    expected = np.empty((num_tokens, num_heads * head_dim), np.float32)
    REF.attention(q, k_host, v_host, batch(compact_tables), head_dim ** -0.5, expected,
                  window=window, softcap=softcap)
    return dict(q_bits=q_bits, k_gpu=k_gpu, v_gpu=v_gpu, gpu_batch=batch(gpu_tables),
                expected=expected, num_heads=num_heads, width=width, window=window,
                softcap=softcap)


def run_ops_attention(cp, case, head_dim):
    batch = case["gpu_batch"]
    ops = make_ops(batch.num_tokens, batch.num_seqs, case["width"], case["num_heads"], head_dim,
                   max_model_len=case["width"] * BLOCK_SIZE)
    meta = ops.upload(batch)
    out = poisoned(cp, case["expected"].shape)
    ops.attention(cp.asarray(case["q_bits"]), case["k_gpu"], case["v_gpu"], meta,
                  head_dim ** -0.5, out, window=case.get("window"), softcap=case.get("softcap"))
    return to_float(cp, out)


MIXED_PREFILL = [(0, 17), (112, 17), (1200, 128), (0, 1), (4000, 99), (1327, 1), (0, 129), (64, 1264)]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_mixed_prefill(cp, rng, head_dim, group):
    """Chunked-prefill style: cached prefixes of many lengths, 1 to 1264 new tokens."""
    case = build_attention_case(cp, rng, MIXED_PREFILL, 2, head_dim, group)
    got = run_ops_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"prefill attention d={head_dim} group={group}")


# (head_dim, 16-row tiles a warp) of every tensor-core prefill kernel
PREFILL_VARIANTS = sorted(attention_kernels.PREFILL_KERNELS)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_long_prefill(cp, rng, head_dim):
    case = build_attention_case(cp, rng, [(0, 4099), (0, 1328)], 1, head_dim, 3)
    got = run_ops_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"long prefill d={head_dim}")
    for d, tiles in PREFILL_VARIANTS:
        if d == head_dim:
            got = run_paged_attention(cp, case, head_dim, prefill_tiles=tiles)
            assert_close(got, case["expected"], 1.5e-2, 1e-2, f"long prefill d={d} t={tiles}")


DECODE = [(0, 1), (16, 1), (128, 1), (1327, 1), (4098, 1), (255, 1), (256, 1), (2047, 1)]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_decode(cp, rng, head_dim, group):
    """Pure decode batch through CudaOps (split-KV chosen automatically for long contexts)."""
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    got = run_ops_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"decode attention d={head_dim} group={group}")


@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
def test_attention_decode_splits(cp, rng, num_splits):
    """Every split count gives the reference result, including empty splits (short sequences)."""
    from cupy_llama.backends.cuda import attention
    head_dim, group = 128, 4
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    batch = case["gpu_batch"]
    out = poisoned(cp, case["expected"].shape)
    partial_out = poisoned(cp, batch.num_seqs * case["num_heads"] * num_splits * head_dim, np.float32)
    partial_lse = poisoned(cp, batch.num_seqs * case["num_heads"] * num_splits, np.float32)
    attention.paged_attention(
        cp.asarray(case["q_bits"]), case["k_gpu"], case["v_gpu"], cp.asarray(batch.block_tables),
        cp.asarray(batch.seq_lens), cp.asarray(batch.query_start_loc), out,
        scale=head_dim ** -0.5, max_query_len=1, max_seq_len=batch.max_seq_len,
        num_splits=num_splits, partial_out=partial_out, partial_lse=partial_lse)
    assert_close(to_float(cp, out), case["expected"], 1.5e-2, 1e-2, f"decode with {num_splits} splits")


def run_paged_attention(cp, case, head_dim, *, num_splits=1, max_seq_len="batch", kernel="auto",
                        clusters=False, prefill_tiles=None):
    """attention.paged_attention on a case, outputs and workspaces poisoned first.
    max_seq_len="batch" passes the batch's longest sequence; None derives split lengths on
    the device (as CUDA-graph decode does)."""
    from cupy_llama.backends.cuda import attention
    batch = case["gpu_batch"]
    if max_seq_len == "batch":
        max_seq_len = batch.max_seq_len
    out = poisoned(cp, case["expected"].shape)
    parts = batch.num_seqs * case["num_heads"] * num_splits
    partial_out = poisoned(cp, parts * head_dim, np.float32)
    partial_lse = poisoned(cp, parts, np.float32)
    attention.paged_attention(
        cp.asarray(case["q_bits"]), case["k_gpu"], case["v_gpu"], cp.asarray(batch.block_tables),
        cp.asarray(batch.seq_lens), cp.asarray(batch.query_start_loc), out,
        scale=head_dim ** -0.5, max_query_len=batch.max_query_len, max_seq_len=max_seq_len,
        num_splits=num_splits, partial_out=partial_out, partial_lse=partial_lse, kernel=kernel,
        clusters=clusters, window=case.get("window"), softcap=case.get("softcap"),
        prefill_tiles=prefill_tiles)
    return to_float(cp, out)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqs", [MIXED_PREFILL, DECODE], ids=["prefill", "decode"])
def test_attention_scalar_fallback(cp, rng, seqs, head_dim):
    """The scalar kernel (other head dims, block sizes, unaligned arrays) stays correct."""
    case = build_attention_case(cp, rng, seqs, 2, head_dim, 4)
    got = run_paged_attention(cp, case, head_dim, kernel="scalar")
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"scalar kernel d={head_dim}")


# prefill rows and keys on both sides of the 64- and 128-row / 64-key tile edges (rows are
# tokens x the group), decode rows mixed in
TILE_EDGES = [(0, 64), (0, 65), (0, 63), (64, 64), (1, 127), (63, 1), (128, 3), (0, 1), (191, 66),
              (0, 2), (0, 128), (0, 129), (3, 33), (0, 31)]


@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("head_dim, tiles", PREFILL_VARIANTS)
def test_attention_prefill_tile_edges(cp, rng, head_dim, tiles, group):
    case = build_attention_case(cp, rng, TILE_EDGES, 2, head_dim, group)
    got = run_paged_attention(cp, case, head_dim, prefill_tiles=tiles)
    assert_close(got, case["expected"], 1.5e-2, 1e-2,
                 f"tile edges d={head_dim} t={tiles} group={group}")


@pytest.mark.parametrize("head_dim, tiles", PREFILL_VARIANTS)
def test_attention_prefill_variants_on_mixed_batches(cp, rng, head_dim, tiles):
    """Every prefill kernel width on chunked-prefill batches (cached prefixes, 1 to 1264 new
    tokens), whichever width the launcher would choose for them."""
    case = build_attention_case(cp, rng, MIXED_PREFILL, 2, head_dim, 4)
    got = run_paged_attention(cp, case, head_dim, prefill_tiles=tiles)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"mixed prefill d={head_dim} t={tiles}")


@pytest.mark.parametrize("block_size", [8, 32, 12])
@pytest.mark.parametrize("seqs", [MIXED_PREFILL, DECODE], ids=["prefill", "decode"])
def test_attention_block_sizes(cp, rng, seqs, block_size):
    """Powers of two take the fast kernels; 12 takes the scalar fallback."""
    head_dim = 64
    case = build_attention_case(cp, rng, seqs, 2, head_dim, 4, block_size=block_size)
    got = run_paged_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, f"block size {block_size}")
    if seqs is DECODE:
        got = run_paged_attention(cp, case, head_dim, num_splits=5, max_seq_len=None)
        assert_close(got, case["expected"], 1.5e-2, 1e-2, f"block size {block_size}, 5 device splits")


@pytest.mark.parametrize("num_splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 2, 3, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_decode_groups(cp, rng, head_dim, group, num_splits):
    """Every CUDA-core decode kernel variant, a kv head's heads in one CTA (up to 8) or
    shared out among 2 CTAs (6 and 8 heads) or 4 (12 and 16; decode_head_parts),
    host-chosen and device-derived split lengths."""
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    for max_seq_len in ("batch", None):
        got = run_paged_attention(cp, case, head_dim, num_splits=num_splits, max_seq_len=max_seq_len,
                                  kernel="decode")
        assert_close(got, case["expected"], 1.5e-2, 1e-2,
                     f"decode d={head_dim} group={group} splits={num_splits} max_seq_len={max_seq_len}")


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_decode_clusters(cp, rng, head_dim, group):
    """The clustered decode kernels (sm_90+), CUDA-core (clusters of 8) and tensor-core
    (clusters of 2, 4 and 8: 3, 5 and 32 splits): contexts from 1 key (all but one of a
    cluster's CTAs without a key) to 4,098 (several steps or tiles per CTA), host- and
    device-derived lengths alike, a CUDA graph's padding row, and large scores."""
    from dataclasses import replace

    from cupy_llama.backends.cuda import attention, launch
    if not launch.launch_attributes_usable():
        pytest.skip("this GPU (or driver) does not launch thread-block clusters")
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    large = build_attention_case(cp, rng, DECODE, 2, head_dim, group, q_scale=12.0)
    batch = case["gpu_batch"]
    padded = replace(batch, seq_lens=np.concatenate([[0], batch.seq_lens[1:]]).astype(np.int32))
    kernels = {"decode": (32,)}
    if head_dim in attention.DECODE_MMA_HEAD_DIMS:
        kernels["decode_mma"] = (3, 5, 32)
    for kernel, split_counts in kernels.items():
        for num_splits in split_counts:
            what = f"{kernel} clusters d={head_dim} group={group} splits={num_splits}"
            for max_seq_len in ("batch", None):
                got = run_paged_attention(cp, case, head_dim, num_splits=num_splits,
                                          max_seq_len=max_seq_len, kernel=kernel, clusters=True)
                assert_close(got, case["expected"], 1.5e-2, 1e-2, f"{what} {max_seq_len}")
            # a padding row (a query, no key: sequence length 0) gives zeros, as the split
            # kernels do, and leaves the other rows alone
            got = run_paged_attention(cp, {**case, "gpu_batch": padded}, head_dim,
                                      num_splits=num_splits, max_seq_len=None, kernel=kernel,
                                      clusters=True)
            expected = case["expected"].copy()
            expected[0] = 0.0
            assert_close(got, expected, 1.5e-2, 1e-2, f"{what} with a padding row")
            got = run_paged_attention(cp, large, head_dim, num_splits=num_splits, kernel=kernel,
                                      clusters=True)
            assert_close(got, large["expected"], 1.5e-2, 1e-2, f"{what} with large scores")


# contexts on both sides of the split and cluster edges: 64-key ranges (SPLIT_ALIGN), one
# step of a CTA (64 keys for every cluster variant up to 4 query heads per kv head), the
# 512 keys up to which a cluster covers a context in one step per CTA, and their doubles
SPLIT_EDGES = [(63, 1), (64, 1), (127, 1), (510, 1), (511, 1), (512, 1), (1023, 1), (1024, 1)]


@pytest.mark.parametrize("group", [1, 2, 4, 6, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_decode_at_split_edges(cp, rng, head_dim, group):
    """The CUDA-core decode kernels, split and clustered, and the tensor-core kernel's
    clusters, where the key ranges end at and just past their edges; with a window of 512
    keys too (Gemma 3's sliding layers), whose ranges start past key 0."""
    from cupy_llama.backends.cuda import attention, launch
    usable = launch.launch_attributes_usable()
    runs = [("decode", False)] + ([("decode", True)] if usable else [])
    if usable and head_dim in attention.DECODE_MMA_HEAD_DIMS:
        runs.append(("decode_mma", True))
    for window in (None, 512):
        case = build_attention_case(cp, rng, SPLIT_EDGES, 2, head_dim, group, window=window)
        for num_splits in (1, 8, 32):
            for max_seq_len in ("batch", None):
                for kernel, clustered in runs:
                    got = run_paged_attention(cp, case, head_dim, num_splits=num_splits,
                                              max_seq_len=max_seq_len, kernel=kernel,
                                              clusters=clustered)
                    assert_close(got, case["expected"], 1.5e-2, 1e-2,
                                 f"{kernel} d={head_dim} group={group} window={window} splits="
                                 f"{num_splits} {max_seq_len} clusters={clustered}")


# the families' batch-1 shapes: (num_heads, num_kv_heads, head_dim, window)
FAMILY_DECODE_SHAPES = {"qwen3-0.6b": (16, 8, 128, None), "gemma-3-1b": (4, 1, 256, 512),
                        "gemma-3-1b full layers": (4, 1, 256, None),
                        "qwen2.5-1.5b": (12, 2, 128, None),
                        "gemma-3-4b": (8, 4, 256, 1024), "gemma-3-4b full layers": (8, 4, 256, None)}


@pytest.mark.parametrize("shape", sorted(FAMILY_DECODE_SHAPES))
def test_attention_decode_of_the_families_through_ops(cp, rng, shape):
    """Batch 1 and 2 of each family's attention shape through CudaOps, as a decode step
    runs it, at contexts the clusters cover in one step per CTA and past them; on sm_90+
    the shapes whose cluster kernel steps 64 keys take it up to 512 keys."""
    from cupy_llama.backends.cuda import attention, launch
    num_heads, num_kv_heads, head_dim, window = FAMILY_DECODE_SHAPES[shape]
    group = num_heads // num_kv_heads
    for seqs in ([(288, 1)], [(511, 1)], [(100, 1), (400, 1)], [(700, 1)], [(2047, 1)]):
        case = build_attention_case(cp, rng, seqs, num_kv_heads, head_dim, group, window=window)
        got = run_ops_attention(cp, case, head_dim)
        assert_close(got, case["expected"], 1.5e-2, 1e-2, f"{shape} decode of {seqs}")
    ops = make_ops(2, 2, 4, num_heads, head_dim, 2048)
    clustered = ops.decode_split(1, num_heads, num_kv_heads, head_dim, 512)[1]
    assert clustered == (launch.launch_attributes_usable()
                         and attention.cluster_max_keys(head_dim, group) == 512), shape


@pytest.mark.parametrize("num_splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_decode_tensor_cores(cp, rng, head_dim, group, num_splits):
    """The tensor-core decode kernel: every group size up to 16 query heads per kv head,
    host-chosen and device-derived split lengths, a CUDA graph's padding row (sequence
    length 0: zeros), rows without a new token, and large scores."""
    from dataclasses import replace
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group)
    for max_seq_len in ("batch", None):
        got = run_paged_attention(cp, case, head_dim, num_splits=num_splits,
                                  max_seq_len=max_seq_len, kernel="decode_mma")
        assert_close(got, case["expected"], 1.5e-2, 1e-2,
                     f"mma decode d={head_dim} group={group} splits={num_splits} {max_seq_len}")
    batch = case["gpu_batch"]
    padded = replace(batch, seq_lens=np.concatenate([[0], batch.seq_lens[1:]]).astype(np.int32))
    got = run_paged_attention(cp, {**case, "gpu_batch": padded}, head_dim, num_splits=num_splits,
                              max_seq_len=None, kernel="decode_mma")
    expected = case["expected"].copy()
    expected[0] = 0.0
    assert_close(got, expected, 1.5e-2, 1e-2, "mma decode with a padding row")
    sparse = build_attention_case(cp, rng, [(100, 1), (300, 0), (0, 1), (77, 0), (2047, 1)], 2,
                                  head_dim, group)
    got = run_paged_attention(cp, sparse, head_dim, kernel="decode_mma")  # splits need 1 token each
    assert_close(got, sparse["expected"], 1.5e-2, 1e-2, "mma decode with empty sequences")
    large = build_attention_case(cp, rng, DECODE, 2, head_dim, group, q_scale=12.0)
    got = run_paged_attention(cp, large, head_dim, num_splits=num_splits, kernel="decode_mma")
    assert_close(got, large["expected"], 1.5e-2, 1e-2, "mma decode with large scores")


def test_attention_decode_batches_route_to_the_tensor_core_kernel(cp, rng):
    """A decode batch of many sequences through CudaOps takes the tensor-core kernel, with
    the split count CudaOps picks."""
    seqs = [(int(n), 1) for n in rng.integers(0, 3000, 20)]
    case = build_attention_case(cp, rng, seqs, 2, 64, 4)
    got = run_ops_attention(cp, case, 64)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, "decode batch of 20 sequences")


def test_attention_decode_rows_without_new_tokens(cp, rng):
    """A sequence with no new token owns no output row and must not disturb the others."""
    head_dim = 64
    seqs = [(100, 1), (300, 0), (0, 1), (77, 0), (2047, 1)]
    case = build_attention_case(cp, rng, seqs, 2, head_dim, 4)
    got = run_paged_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, "decode with empty sequences")


def test_attention_large_values(cp, rng):
    """Scores far from 0 (q scaled up 12x): the online softmax must not overflow or lose
    the maximum between tiles, slots and splits."""
    head_dim = 128
    case = build_attention_case(cp, rng, [(0, 300), (2000, 1), (500, 40)], 2, head_dim, 4,
                                q_scale=12.0)
    got = run_paged_attention(cp, case, head_dim)
    assert_close(got, case["expected"], 1.5e-2, 1e-2, "prefill attention with large scores")
    decode = build_attention_case(cp, rng, DECODE, 2, head_dim, 4, q_scale=12.0)
    got = run_paged_attention(cp, decode, head_dim, num_splits=7)
    assert_close(got, decode["expected"], 1.5e-2, 1e-2, "decode attention with large scores")


def test_upload_round_trip(cp, rng):
    tables = rng.integers(0, NUM_POOL_BLOCKS, (3, 7)).astype(np.int32)
    batch = ForwardBatch(token_ids=rng.integers(0, 1000, 10).astype(np.int32),
                         positions=np.arange(10, dtype=np.int32),
                         slot_mapping=rng.integers(0, 1000, 10).astype(np.int32),
                         query_start_loc=np.array([0, 2, 9, 10], np.int32),
                         seq_lens=np.array([5, 7, 12], np.int32), block_tables=tables,
                         max_query_len=7, max_seq_len=12)
    ops = make_ops(16, 4, 8, 4, 64, 128)
    for _ in range(2):  # the staging buffer is reused
        meta = ops.upload(batch)
        for name in ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                     "block_tables", "last_token_indices"):
            np.testing.assert_array_equal(cp.asnumpy(getattr(meta, name)), getattr(batch, name),
                                          err_msg=name)
        assert (meta.num_tokens, meta.num_seqs, meta.max_query_len, meta.max_seq_len,
                meta.is_decode_only) == (10, 3, 7, 12, False)


# -------------------------------------------------------------------------- sampling

def sampling_tensors(num_seqs, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, steps=0):
    full = lambda value, dtype: np.broadcast_to(np.asarray(value, dtype), (num_seqs,)).copy()
    return SamplingTensors(
        temperature=full(temperature, np.float32), top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32), min_p=full(min_p, np.float32),
        seeds=full(0 if seeds is None else seeds, np.uint64), steps=full(steps, np.int32))


def test_greedy_is_argmax(cp, rng):
    num_seqs, vocab = 8, 128256
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 4
    logits[3, 1000] = logits[3, 90000] = logits[3].max() + 1  # a tie: the lower index wins
    logits[5, :] = 0.0                                          # all equal: token 0
    ops = make_ops(num_seqs, num_seqs, 1, 1, 64, 16)
    tokens = ops.sample(cp.asarray(logits), sampling_tensors(num_seqs))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    top1 = ops.sample(cp.asarray(logits), sampling_tensors(
        num_seqs, temperature=1.0, top_k=1, seeds=rng.integers(0, 2**63, num_seqs)))
    np.testing.assert_array_equal(top1, np.argmax(logits, axis=-1), err_msg="top_k=1 vs greedy")
    # a vocabulary that is not a multiple of 4: rows at a 16-byte boundary (0, 4) read four
    # logits per load and their last three one by one; the others (2) one by one
    odd = rng.standard_normal((num_seqs, vocab - 1), dtype=np.float32)
    odd[0, -1] = odd[0].max() + 1                # the maximum in the last, unaligned part
    odd[4, 7] = odd[4, -2] = odd[4].max() + 1    # a tie across both parts: the lower index
    odd[2, 5] = np.nan                           # NaN never wins
    odd[2, 3] = odd[2, 130] = np.nanmax(odd[2]) + 1
    tokens = ops.sample(cp.asarray(odd), sampling_tensors(num_seqs))
    np.testing.assert_array_equal(tokens, np.nanargmax(odd, axis=-1), err_msg="odd vocabulary")
    assert tokens[0] == vocab - 2 and tokens[4] == 7 and tokens[2] == 3


@pytest.mark.parametrize("vocab", [262144, 128256, 128255])
def test_a_split_argmax_draws_what_one_cta_draws(cp, rng, vocab):
    """sampling.cu's "Split argmax": rows of 1 to 3 sequences, their argmax pass shared by
    2 to ARGMAX_MAX_SPLITS CTAs, pick the tokens of the unsplit pass and of NumPy: maxima
    at share edges and in the unaligned last logits, ties across shares to the lower index,
    NaN never, a row of NaN token 0, masked rows, MASK_SKIP rows untouched. Sampled rows
    draw the same tokens and use the same slots, each count is added once, and the tickets
    are back at 0 after every launch (the same launch again draws the same)."""
    from cupy_llama.backends.cuda import sampling
    from cupy_llama.structured import apply_token_bitmask, bitmask_words
    assert sampling.argmax_splits(1, vocab) > 1  # what the engine's batch-1 steps launch
    num_seqs = 3
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 4
    top = np.nanmax(logits) + 1
    share = cdiv(vocab // 4, 7) * 4  # the first share's end at 7 splits (an aligned row)
    logits[0, share - 1] = logits[0, share] = top  # a tie across a share edge
    logits[1, vocab - 1] = top + 1                   # the last logit
    logits[1, 17] = np.nan
    logits[2, :] = np.nan
    want = np.array([share - 1, vocab - 1, 0])
    words = bitmask_words(vocab)
    bits = np.zeros((1, words * 32), bool)
    bits[0, rng.choice(vocab, 50, replace=False)] = True
    bitmask = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)
    masked = logits[:1].copy()
    apply_token_bitmask(masked, bitmask, np.zeros(1, np.int32))
    seeds = rng.integers(0, 2**63, num_seqs)
    for rows in (1, 2, 3):
        for splits in (1, 2, 7, sampling.ARGMAX_MAX_SPLITS):
            for launch in range(2):
                out = cp.full(rows, -7, np.int32)
                sampling.sample(cp.asarray(logits[:rows]), *greedy(cp, rows), out, splits=splits)
                np.testing.assert_array_equal(out.get(), want[:rows], err_msg=f"{splits} {launch}")
        # masked rows, a skipped row
        out = cp.full(2, -7, np.int32)
        sampling.sample(cp.asarray(logits[:2]), *greedy(cp, 2), out, splits=5,
                        bitmask=cp.asarray(bitmask),
                        mask_rows=cp.asarray([0, sampling.MASK_SKIP], np.int32))
        assert out.get().tolist() == [int(np.argmax(masked[0])), -7]
    # sampled rows: the same draws, slots and counts split or not
    warm = rng.standard_normal((2, vocab), dtype=np.float32) * 2
    drawn = {}
    for splits in (1, 9, sampling.ARGMAX_MAX_SPLITS):
        state = sampling.SlotState(cp, 2, vocab)
        tokens, used = cp.full(2, -1, np.int32), cp.full(2, -1, np.int32)
        packed = sampling.pack_settings(2, temperature=np.float32(0.8), top_p=np.float32(0.9),
                                        seeds=seeds[:2].astype(np.uint64),
                                        state_slot=np.array([1, 0], np.int32),
                                        count_token=np.int32(1))
        sampling.sample_settings(cp.asarray(warm), packed, 2, tokens, used_slots=used,
                                 counts=state.counts, splits=splits)
        drawn[splits] = (tokens.get().tolist(), used.get().tolist(), state.counts.get())
        assert drawn[splits][2].sum() == 2
    for splits in drawn:
        assert drawn[splits][:2] == drawn[1][:2], splits
        np.testing.assert_array_equal(drawn[splits][2], drawn[1][2])
    with pytest.raises(ValueError, match=r"splits must be in \[1, "):
        sampling.sample(cp.asarray(logits[:1]), *greedy(cp, 1), cp.zeros(1, np.int32),
                        splits=sampling.ARGMAX_MAX_SPLITS + 1)


def greedy(cp, n):
    """sampling.sample's settings of n greedy rows."""
    zeros = lambda dtype: cp.zeros(n, dtype)
    return (zeros(np.float32), zeros(np.int32), cp.ones(n, np.float32), zeros(np.float32),
            zeros(np.uint64), zeros(np.int32))


@pytest.mark.parametrize("vocab", [128256, 49152, 1001])
def test_logprobs_of_the_rows_that_ask(cp, rng, vocab):
    """logprobs.cu against the NumPy backend's log-softmax: only the rows that ask, each
    with its own k (the call computes the largest), the sampled token first; ties to the
    lower id, NaN never among the top."""
    from cupy_llama.backends.numpy_ops import logprobs as reference
    num_seqs = 12
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 4
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1  # a tie at the top
    logits[5, 7] = np.nan
    logits[5, 8] = np.nanmax(logits[5]) + 2
    logits[8, 12] = logits[8, 13] = logits[8].max() + 1  # a tie inside one group of four
    logits[11, : vocab // 2] = -np.inf  # masked first half: sums start past it
    logits[11, vocab - 3] = logits[11].max() + 1  # the maximum in the last few
    ops = make_ops(num_seqs, num_seqs, 1, 1, 64, 16)
    asks = np.array([-1, 3, 20, -1, 0, 5, -1, 1, 2, -1, -1, 7], np.int32)
    settings = sampling_tensors(num_seqs, temperature=np.where(np.arange(num_seqs) % 2, 0.8, 0.0),
                                seeds=rng.integers(0, 2**63, num_seqs), steps=1)
    settings.num_logprobs = asks
    pending = ops.sample_async(cp.asarray(logits), settings)
    tokens = pending.get()
    got = pending.logprobs()
    rows = np.flatnonzero(asks >= 0)
    np.testing.assert_array_equal(got.rows, rows)
    want = reference(logits, tokens, rows, int(asks.max()))
    for row in rows:
        k = int(asks[row])
        token, value, top = got.of_row(int(row), k)
        want_token, want_value, want_top = want.of_row(int(row), k)
        assert token == tokens[row] == want_token
        assert abs(value - want_value) < 1e-4, (row, value, want_value)
        assert [i for i, _ in top] == [i for i, _ in want_top], row
        np.testing.assert_allclose([v for _, v in top], [v for _, v in want_top], atol=1e-4)
    assert got.of_row(2, 2)[2][0][0] == 10 and got.of_row(5, 1)[2][0][0] == 8
    assert got.of_row(8, 2)[2][0][0] == 12 and got.of_row(11, 7)[2][0][0] == vocab - 3
    # a step where no row asks keeps the plain path
    plain = ops.sample_async(cp.asarray(logits), sampling_tensors(num_seqs))
    plain.get()
    assert plain.logprobs() is None


@pytest.mark.parametrize("vocab", [128256, 1001, 12])
def test_logprobs_of_one_and_of_many_agree(cp, rng, vocab):
    """logprobs.cu's two kernels (a list of one pair per thread for k <= 1, of k for more)
    give a row the same bits for the sampled token and the first of the top k, and the
    list of many equals the NumPy top k; a vocabulary smaller than k pads with id 0, -inf;
    the sampled tokens' ranks equal the NumPy ones (ties to the lower id, NaN last)."""
    from cupy_llama.backends.cuda import logprobs as logprob_kernels
    from cupy_llama.backends.numpy_ops import logprobs as reference, token_ranks
    rows_n = 6
    logits = rng.standard_normal((rows_n, vocab), dtype=np.float32) * 3
    logits[1, : vocab // 3] = -np.inf
    tokens = rng.integers(0, vocab, rows_n).astype(np.int32)
    tokens[1] = vocab - 1
    rows = np.arange(rows_n, dtype=np.int32)
    logits[2, :] = logits[2, tokens[2]]  # a row of ties: the token ranks after lower ids
    logits[3, 5] = np.nan                 # NaN ranks last
    got = {}
    for k in (1, 20):
        values = cp.empty((rows_n, 1 + k), np.float32)
        ids = cp.empty((rows_n, 1 + k), np.int32)
        ranks = cp.empty(rows_n, np.int32)
        logprob_kernels.logprobs(cp.asarray(logits), cp.asarray(rows), cp.asarray(tokens), k,
                                 values, ids, ranks)
        got[k] = (values.get(), ids.get())
        np.testing.assert_array_equal(ranks.get(), token_ranks(logits, tokens))
    np.testing.assert_array_equal(got[1][0], got[20][0][:, :2])
    np.testing.assert_array_equal(got[1][1], got[20][1][:, :2])
    want = reference(logits, tokens, rows, min(20, vocab))
    values, ids = got[20]
    np.testing.assert_array_equal(ids[:, : 1 + min(20, vocab)], want.ids)
    np.testing.assert_allclose(values[:, : 1 + min(20, vocab)], want.values, atol=1e-4)
    if vocab < 20:
        assert (ids[:, 1 + vocab:] == 0).all() and np.isneginf(values[:, 1 + vocab:]).all()


def test_seeded_sampling_is_reproducible(cp, rng):
    num_seqs, vocab = 16, 128256
    logits = cp.asarray(rng.standard_normal((num_seqs, vocab), dtype=np.float32) * 3)
    ops = make_ops(num_seqs, num_seqs, 1, 1, 64, 16)
    seeds = rng.integers(0, 2**64, num_seqs, dtype=np.uint64)
    settings = dict(temperature=1.0, top_p=0.95, seeds=seeds)
    first = ops.sample(logits, sampling_tensors(num_seqs, steps=3, **settings))
    for _ in range(8):  # the top-p mass sums must not depend on the threads' order
        again = ops.sample(logits, sampling_tensors(num_seqs, steps=3, **settings))
        np.testing.assert_array_equal(first, again, err_msg="same seed and step, different tokens")
    later = ops.sample(logits, sampling_tensors(num_seqs, steps=4, **settings))
    assert (later != first).any(), "the step number does not change the draw"
    # a request's draw does not depend on its place in the batch
    order = rng.permutation(num_seqs)
    permuted = ops.sample(logits[cp.asarray(order)], sampling_tensors(
        num_seqs, steps=3, temperature=1.0, top_p=0.95, seeds=seeds[order]))
    np.testing.assert_array_equal(permuted, first[order])


def test_filters_never_pick_a_filtered_token(cp, rng):
    num_seqs, vocab, draws = 64, 128256, 12
    logits = rng.standard_normal((num_seqs, vocab), dtype=np.float32) * rng.uniform(1, 6, (num_seqs, 1)).astype(np.float32)
    params = dict(temperature=rng.uniform(0.3, 1.5, num_seqs),
                  top_k=rng.choice([0, 1, 5, 50, 1000], num_seqs),
                  top_p=rng.choice([1.0, 0.95, 0.7, 0.3], num_seqs),
                  min_p=rng.choice([0.0, 0.01, 0.1, 0.5], num_seqs))
    ops = make_ops(num_seqs, num_seqs, 1, 1, 64, 16)
    logits_dev = cp.asarray(logits)
    seeds = rng.integers(0, 2**63, num_seqs)
    support = []
    for b in range(num_seqs):
        t, k, p, m = (float(params["temperature"][b]), int(params["top_k"][b]),
                      float(params["top_p"][b]), float(params["min_p"][b]))
        # float32 on the GPU vs float64 here: allow a hair of slack at the cut-offs
        loose = filtered_probs(logits[b], t, k, min(1.0, p + 1e-4) if p < 1 else 1.0, m * (1 - 1e-4)) > 0
        support.append(loose)
    for step in range(draws):
        tokens = ops.sample(logits_dev, sampling_tensors(
            num_seqs, temperature=params["temperature"], top_k=params["top_k"],
            top_p=params["top_p"], min_p=params["min_p"], seeds=seeds, steps=step))
        for b, token in enumerate(tokens):
            assert 0 <= token < vocab and support[b][token], (
                f"row {b} step {step}: token {token} is filtered out (temperature "
                f"{params['temperature'][b]:.3f}, top_k {params['top_k'][b]}, top_p "
                f"{params['top_p'][b]}, min_p {params['min_p'][b]}; support size "
                f"{support[b].sum()})")


def load_script(name):
    """A module of scripts/ (not a package), loaded from its file."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Rows shaped like a trained model's next-token logits, the rows the sampling benchmark
# times: a wide low bulk far below 60 to 400 tokens near the top (within about 5 of each
# other, so at temperature 0.6 and more all of them are candidates), some of them tied.
peaked_logits = load_script("bench_sampling").peaked_rows


SLOT_CASES = [  # (temperature, top_k, top_p, min_p)
    (0.6, 0, 0.9, 0.0), (0.8, 50, 0.9, 0.0), (1.0, 20, 1.0, 0.0), (0.7, 0, 0.5, 0.05),
    (1.0, 3, 1.0, 0.0), (1.2, 0, 0.0, 0.0), (0.6, 0, 0.98, 0.0),
]


@pytest.mark.parametrize("vocab", [128256, 128255])
@pytest.mark.parametrize("case", range(len(SLOT_CASES)))
def test_candidate_slots_draw_what_the_row_draws(cp, rng, case, vocab):
    """The passes over the candidate slots pick the very token the passes over the whole row
    pick, for every seed and step, and serve every row of a peaked batch; with an odd
    vocabulary (rows on and off 16-byte boundaries) too, and with -0.0 and NaN logits (a
    NaN weighs 0; one with the sign bit clear sorts above every logit, so it is a
    candidate and counts for top-k)."""
    from cupy_llama.backends.cuda import sampling
    temperature, top_k, top_p, min_p = SLOT_CASES[case]
    num_seqs = 16
    host = peaked_logits(rng, num_seqs, vocab)
    host[:, :8] = -0.0
    host[:, 8] = np.copysign(np.float32(np.nan), np.float32(-1))
    host[::2, 9] = np.float32(np.nan)
    logits = cp.asarray(host)
    seeds = cp.asarray(rng.integers(0, 2**64, num_seqs, dtype=np.uint64))
    f32 = lambda v: cp.full(num_seqs, v, np.float32)
    settings = (f32(temperature), cp.full(num_seqs, top_k, np.int32), f32(top_p), f32(min_p), seeds)
    assert sampling.default_slots() > 0
    for step in range(6):
        steps = cp.full(num_seqs, step, np.int32)
        drawn = {}
        for slots in (None, 0):
            out, used = cp.full(num_seqs, -1, np.int32), cp.full(num_seqs, -1, np.int32)
            sampling.sample(logits, *settings, steps, out, slots=slots, used_slots=used)
            drawn[slots] = cp.asnumpy(out)
            np.testing.assert_array_equal(cp.asnumpy(used), 1 if slots is None else 0,
                                          err_msg=f"rows served by the slots, slots={slots}")
        np.testing.assert_array_equal(drawn[None], drawn[0], err_msg=f"step {step}")
        # both ways wrong alike would pass the line above: a NaN weighs 0, never drawn
        assert not np.isin(drawn[None], [8, 9]).any(), f"step {step}: a NaN logit drawn"
        assert ((drawn[None] >= 0) & (drawn[None] < vocab)).all()


def test_candidate_slots_step_aside_when_they_cannot_serve(cp, rng):
    """Flat rows overflow the slots, a top-k larger than the candidates needs the whole row,
    and greedy rows never use them: each still draws from the right set."""
    from cupy_llama.backends.cuda import sampling
    num_seqs, vocab = 3, 128256
    logits = peaked_logits(rng, num_seqs, vocab)
    logits[0] = rng.standard_normal(vocab) * 0.1  # flat: tens of thousands of candidates
    temperature = np.array([1.0, 0.6, 0.0], np.float32)
    top_k = np.array([0, 5000, 0], np.int32)
    top_p = np.array([0.9, 1.0, 1.0], np.float32)
    out, used = cp.full(num_seqs, -1, np.int32), cp.full(num_seqs, -1, np.int32)
    sampling.sample(cp.asarray(logits), cp.asarray(temperature), cp.asarray(top_k),
                    cp.asarray(top_p), cp.zeros(num_seqs, np.float32),
                    cp.arange(num_seqs, dtype=np.uint64), cp.zeros(num_seqs, np.int32), out,
                    used_slots=used)
    np.testing.assert_array_equal(cp.asnumpy(used), [0, 0, 0])
    tokens = cp.asnumpy(out)
    for b in range(2):
        support = filtered_probs(logits[b], float(temperature[b]), int(top_k[b]),
                                 min(1.0, float(top_p[b]) + 1e-4), 0.0) > 0
        assert support[tokens[b]], f"row {b}: token {tokens[b]} is filtered out"
    assert tokens[2] == int(np.argmax(logits[2]))


SMALL_VOCAB_CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=12, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.83, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.07),
    dict(temperature=0.9, top_k=20, top_p=0.91, min_p=0.02),
]


@pytest.mark.parametrize("slots", [None, 0])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("case", range(len(SMALL_VOCAB_CASES)))
def test_sampling_distribution(cp, rng, case, ties, slots):
    """Many seeds on one small-vocabulary row: the token frequencies match filtered_probs
    (tokens outside its support never appear; chi-square over the support), with the
    candidate slots (every token of this row is a candidate) and without."""
    from cupy_llama.backends.cuda import sampling
    params = SMALL_VOCAB_CASES[case]
    vocab, draws = 40, 40000
    logits = rng.standard_normal(vocab).astype(np.float32) * 1.5
    if ties:  # few distinct values: ties at the top-k / top-p boundaries
        logits = np.round(logits * 2) / 2
    expected = filtered_probs(logits, params["temperature"], params["top_k"], params["top_p"],
                              params["min_p"])
    f32 = lambda v: cp.full(draws, v, np.float32)
    out, used = cp.full(draws, -1, np.int32), cp.full(draws, -1, np.int32)
    sampling.sample(cp.asarray(np.broadcast_to(logits, (draws, vocab)).copy()),
                    f32(params["temperature"]), cp.full(draws, params["top_k"], np.int32),
                    f32(params["top_p"]), f32(params["min_p"]),
                    cp.asarray(rng.integers(0, 2**64, draws, dtype=np.uint64)),
                    cp.zeros(draws, np.int32), out, slots=slots, used_slots=used)
    # every token of this row is a candidate: the slots serve top-k and top-p draws, and
    # min-p ones past the candidates' cut
    from cupy_llama.backends.cuda.kernels import constants
    filtered = (params["top_k"] > 0 or params["top_p"] < 1
                or params["min_p"] >= constants("sampling")["MIN_P_OF_CANDIDATES"])
    assert (cp.asnumpy(used) == int(slots is None and filtered)).all()
    tokens = cp.asnumpy(out)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts.size == vocab, f"token ids out of range: max {tokens.max()}"
    outside = counts[expected == 0].sum()
    assert outside == 0, f"{outside} draws of filtered tokens {np.flatnonzero((expected == 0) & (counts > 0))}"
    # chi-square over tokens expected at least 5 times, the rarer ones pooled in one bin
    wanted = expected * draws
    common = wanted >= 5
    observed_bins = list(counts[common]) + [counts[~common & (expected > 0)].sum()]
    wanted_bins = list(wanted[common]) + [wanted[~common].sum()]
    if wanted_bins[-1] < 5:
        observed_bins, wanted_bins = observed_bins[:-1], wanted_bins[:-1]
    observed_bins, wanted_bins = np.array(observed_bins, float), np.array(wanted_bins)
    chi2 = float(((observed_bins - wanted_bins) ** 2 / wanted_bins).sum())
    dof = max(1, len(wanted_bins) - 1)
    bound = dof + 6 * np.sqrt(2 * dof) + 10
    assert chi2 < bound, (f"chi-square {chi2:.1f} over {dof} degrees of freedom (bound {bound:.1f}); "
                          f"counts {observed_bins.tolist()} vs expected {np.round(wanted_bins).tolist()}")
