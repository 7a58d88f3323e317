"""The fused skinny kernels of gemv.cu (norm before the product; SiLU-and-mul, RoPE and the
KV-cache write, or the residual add after it) against the float32 NumPy reference ops
composed the same way, on bf16-rounded inputs; and programmatic launches against plain
ones. Needs CuPy and a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from test_cuda_ops import (BLOCK_SIZE, REF, _gpu_available, assert_close,
                           build_attention_case, make_ops, poisoned, random_bf16, rope_table,
                           to_float)
from test_cuda_ops import cp, rng  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]

ROWS = (1, 2, 7, 8, 9, 16)
EPS = 1e-5


@pytest.fixture
def skinny_mma():
    from cupy_llama.backends.cuda import gemm
    previous = gemm.skinny_gemm()
    gemm.set_skinny_gemm("mma")
    yield
    gemm.set_skinny_gemm(previous)


def _relative_error(got, expected) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert not np.isnan(got).any(), "NaN left in the output"
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def _normed(x, norm_w):
    """What the fused prologue stages: rms_norm(x) * w rounded to bf16."""
    h = np.empty_like(x)
    REF.rms_norm(x, norm_w, EPS, h)
    return bf16_bits_to_float32(float32_to_bf16_bits(h))


def _residual(rng, m, k):
    return (rng.standard_normal((m, k), dtype=np.float32) * np.float32(3.0)).astype(np.float32)


@pytest.mark.parametrize("m", ROWS + (40,))
@pytest.mark.parametrize("k,n", [(2048, 2048), (8192, 2048), (200, 1001)])
def test_linear_accumulates_into_float32(cp, rng, m, k, n):
    """out += x @ w.T: the skinny kernel up to 16 rows (cuBLAS where shared memory is too
    small, and past 16 rows), cuBLAS with beta = 1 beyond."""
    from cupy_llama.backends.cuda import gemm
    x_bits, x = random_bf16(rng, (m, k))
    w_bits, w = random_bf16(rng, (n, k), scale=0.02)
    start = _residual(rng, m, n)
    out = cp.asarray(start)
    gemm.linear(cp.asarray(x_bits), cp.asarray(w_bits), out, accumulate=True)
    added = cp.asnumpy(out).astype(np.float64) - start
    rel = _relative_error(added, x.astype(np.float64) @ w.T.astype(np.float64))
    assert rel < 1e-2, f"accumulate [{m},{k}]x[{n},{k}]^T: relative error of the update {rel:.3g}"
    with pytest.raises(ValueError, match="float32"):
        gemm.linear(cp.asarray(x_bits), cp.asarray(w_bits), cp.empty((m, n), np.uint16),
                    accumulate=True)


@pytest.mark.parametrize("out_dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("k,n", [(2048, 3072), (576, 49152), (64, 37)])
def test_norm_linear(cp, rng, k, n, out_dtype, skinny_mma):
    """Under "mma" the fused kernel runs (under "auto" it runs where the choice table names
    the skinny kernel for the product)."""
    from cupy_llama.backends.cuda import gemm
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (n, k), scale=0.02)
    w_dev = cp.asarray(w_bits)
    for m in ROWS:
        x = _residual(rng, m, k)
        expected = _normed(x, norm_w).astype(np.float64) @ w.T.astype(np.float64)
        out = poisoned(cp, (m, n), out_dtype)
        assert gemm.norm_linear(cp.asarray(x), cp.asarray(norm_bits), EPS, w_dev, out)
        rel = _relative_error(to_float(cp, out), expected)
        assert rel < 1e-2, f"norm_linear m={m} [{k}]x[{n}]: relative error {rel:.3g}"


@pytest.mark.parametrize("k,inter", [(2048, 8192), (576, 1536), (64, 8)])
def test_norm_gate_up_silu(cp, rng, k, inter):
    from cupy_llama.backends.cuda import gemm
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (2 * inter, k), scale=0.05)
    w_dev = cp.asarray(w_bits)
    for m in ROWS:
        x = _residual(rng, m, k)
        gate_up = bf16_bits_to_float32(float32_to_bf16_bits(_normed(x, norm_w) @ w.T))
        expected = np.empty((m, inter), np.float32)
        REF.silu_and_mul(gate_up, expected)
        out = poisoned(cp, (m, inter))
        assert gemm.norm_gate_up_silu(cp.asarray(x), cp.asarray(norm_bits), EPS, w_dev, out)
        rel = _relative_error(to_float(cp, out), expected)
        assert rel < 1e-2, f"norm_gate_up_silu m={m} [{k}] -> [{inter}]: relative error {rel:.3g}"


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 32, 8), (128, 8, 2), (64, 9, 3)])
def test_norm_qkv_rope_matches_the_composed_ops(cp, rng, head_dim, num_heads, num_kv_heads):
    """Rotated q, and the k / v rows written at each token's slot (a slot of -1 writes
    nothing; every other cache slot stays NaN)."""
    from cupy_llama.backends.cuda import gemm
    k, num_blocks = 512, 8
    width = (num_heads + 2 * num_kv_heads) * head_dim
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (width, k), scale=0.05)
    cos_sin = rope_table(4096, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    for m in ROWS:
        x = _residual(rng, m, k)
        positions = rng.integers(0, 4096, m).astype(np.int32)
        slots = rng.choice(num_blocks * BLOCK_SIZE, m, replace=False).astype(np.int32)
        if m > 1:
            slots[0] = -1

        class Meta:
            def __init__(self, keep):
                self.positions, self.slot_mapping = positions[keep], slots[keep]

        qkv = bf16_bits_to_float32(float32_to_bf16_bits(_normed(x, norm_w) @ w.T))
        q_ref = np.empty((m, num_heads, head_dim), np.float32)
        k_ref = np.full(cache_shape, np.nan, np.float32)
        v_ref = np.full(cache_shape, np.nan, np.float32)
        everything, written = np.ones(m, bool), slots >= 0
        REF.rope_and_cache(qkv, Meta(everything), cos_sin, k_ref.copy(), v_ref.copy(), q_ref)
        REF.rope_and_cache(qkv[written], Meta(written), cos_sin, k_ref, v_ref,
                           np.empty((int(written.sum()), num_heads, head_dim), np.float32))

        q_out = poisoned(cp, (m, num_heads, head_dim))
        k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
        assert gemm.norm_qkv_rope(cp.asarray(x), cp.asarray(norm_bits), EPS, cp.asarray(w_bits),
                                  cp.asarray(positions), cp.asarray(slots), cp.asarray(cos_sin),
                                  k_cache, v_cache, q_out)
        what = f"norm_qkv_rope m={m} d={head_dim} heads {num_heads}/{num_kv_heads}"
        for name, got, ref in (("q", q_out, q_ref), ("k cache", k_cache, k_ref),
                               ("v cache", v_cache, v_ref)):
            got = to_float(cp, got)
            assert (np.isnan(got) == np.isnan(ref)).all(), f"{what}: {name} written at the wrong slots"
            finite = ~np.isnan(ref)
            rel = _relative_error(got[finite], ref[finite])
            assert rel < 1e-2, f"{what}: {name} relative error {rel:.3g}"
            # each value rounds once from nearly the same fp32 sum: all but a few are equal
            assert_close(got[finite], ref[finite], 0.05, 0.05, f"{what}: {name}")


def test_programmatic_launches_give_the_same_bits_eager_and_in_a_graph(cp, rng):
    """The programmatic (overlapping) launch only moves when a kernel starts: a chain of
    fused products gives the same bits with it on or off, eagerly and replayed from a
    CUDA graph."""
    from cupy_llama.backends.cuda import gemm, launch
    k, n = 2048, 2048
    norm_bits, _ = random_bf16(rng, (k,))
    w_bits, _ = random_bf16(rng, (n, k), scale=0.02)
    up_bits, _ = random_bf16(rng, (2 * n, k), scale=0.02)
    norm_w, w, up = cp.asarray(norm_bits), cp.asarray(w_bits), cp.asarray(up_bits)
    start = _residual(rng, 4, k)

    def chain(residual, act):
        for _ in range(3):
            gemm.norm_gate_up_silu(residual, norm_w, EPS, up, act)
            gemm.linear(act[:, :k], w, residual, accumulate=True)

    results = {}
    previous = launch.programmatic()
    try:
        for on in (False, True):
            launch.set_programmatic(on)
            residual, act = cp.asarray(start), cp.empty((4, n), np.uint16)
            chain(residual, act)
            results[("eager", on)] = cp.asnumpy(residual)
            stream = cp.cuda.Stream(non_blocking=True)
            residual, act = cp.asarray(start), cp.empty((4, n), np.uint16)
            with stream:
                stream.begin_capture()
                chain(residual, act)
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            results[("graph", on)] = cp.asnumpy(residual)
    finally:
        launch.set_programmatic(previous)
    reference = results[("eager", False)]
    assert not np.isnan(reference).any()
    for key, value in results.items():
        np.testing.assert_array_equal(value, reference, err_msg=f"{key} differs from eager, plain launches")


COMBINE_BATCHES = {
    "one": [(287, 1)],
    "three": [(5, 1), (900, 1), (0, 1)],
    "sixteen": [(c, 1) for c in (0, 3, 64, 65, 127, 128, 300, 511, 700, 1, 33, 250, 999, 64, 2, 400)],
}


@pytest.mark.parametrize("num_splits", [2, 7, 32])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 2)])
@pytest.mark.parametrize("batch_name", list(COMBINE_BATCHES))
def test_combine_linear_adds_what_the_merge_kernel_then_the_product_add(cp, rng, batch_name,
                                                                         head_dim, group,
                                                                         num_splits):
    """o_proj with the split merge in its prologue adds the same bits as the merge kernel
    followed by the skinny product, with the batch's split lengths and with lengths derived
    on the device (CUDA graphs: empty splits past short sequences)."""
    from cupy_llama.backends.cuda import attention, gemm
    case = build_attention_case(cp, rng, COMBINE_BATCHES[batch_name], 2, head_dim, group)
    batch, num_heads = case["gpu_batch"], case["num_heads"]
    num_seqs, n = batch.num_seqs, 384
    w_bits, _ = random_bf16(rng, (n, num_heads * head_dim), scale=0.02)
    weight = cp.asarray(w_bits)
    start = _residual(rng, num_seqs, n)
    tables, seq_lens = cp.asarray(batch.block_tables), cp.asarray(batch.seq_lens)
    query_start_loc = cp.asarray(batch.query_start_loc)
    combined = 0
    for max_seq_len in (batch.max_seq_len, None):
        parts = num_seqs * num_heads * num_splits
        partial_out = poisoned(cp, parts * head_dim, np.float32)
        partial_lse = poisoned(cp, parts, np.float32)
        attn = poisoned(cp, case["expected"].shape)
        splits = attention.paged_attention(
            cp.asarray(case["q_bits"]), case["k_gpu"], case["v_gpu"], tables, seq_lens,
            query_start_loc, attn, scale=head_dim ** -0.5, max_query_len=1,
            max_seq_len=max_seq_len, num_splits=num_splits, partial_out=partial_out,
            partial_lse=partial_lse)
        assert_close(to_float(cp, attn), case["expected"], 1.5e-2, 1e-2, "attention")
        if splits == 1:
            continue  # contexts too short to split: nothing to merge
        expected = cp.asarray(start)
        gemm.mma(attn, weight, expected, accumulate=True)
        got = cp.asarray(start)
        gemm.combine_linear(partial_out, partial_lse, num_seqs, num_heads, head_dim, splits,
                            weight, got)
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(expected),
                                      err_msg=f"{splits} splits, max_seq_len={max_seq_len}")
        combined += 1
    assert combined, "no case had splits to merge"


def test_attention_output_fused_matches_composed(cp, rng):
    """CudaOps.attention_output (the merge in o_proj's prologue for split decode steps)
    adds the same bits as attention and then linear(accumulate=True), and leaves `attn`
    alone."""
    from cupy_llama.backends.base import SublayerOps
    head_dim, group = 64, 4
    case = build_attention_case(cp, rng, [(1500, 1), (40, 1), (3000, 1)], 2, head_dim, group)
    batch, num_heads = case["gpu_batch"], case["num_heads"]
    ops = make_ops(batch.num_tokens, batch.num_seqs, case["width"], num_heads, head_dim,
                   max_model_len=case["width"] * BLOCK_SIZE)
    meta = ops.upload(batch)
    q = cp.asarray(case["q_bits"])
    assert ops._decode_splits(q, case["k_gpu"], meta) > 1, "the step should split"
    w_bits, _ = random_bf16(rng, (256, num_heads * head_dim), scale=0.02)
    weight = cp.asarray(w_bits)
    start = _residual(rng, batch.num_tokens, 256)
    fused, composed = cp.asarray(start), cp.asarray(start)
    attn = poisoned(cp, case["expected"].shape)
    ops.attention_output(q, case["k_gpu"], case["v_gpu"], meta, head_dim ** -0.5, weight, attn, fused)
    assert np.isnan(to_float(cp, attn)).all(), "the fused path wrote attn"
    SublayerOps.attention_output(ops, q, case["k_gpu"], case["v_gpu"], meta, head_dim ** -0.5,
                                 weight, poisoned(cp, case["expected"].shape), composed)
    np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(composed))
