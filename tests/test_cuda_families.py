"""The kernel paths of the families beside Llama against the float32 NumPy reference, on
fresh random bf16 inputs (outputs poisoned first, never-written KV slots NaN), then each
family's whole model on the GPU against the CPU: eagerly, from the decode and step CUDA
graphs, and with the fused skinny products.

- norms scaling by (1 + w) (Gemma), the norm that adds a sublayer's output into the
  residual stream (in place, into another buffer, and inside the normed skinny products
  that open the next sublayer), GeGLU's tanh GELU, soft-capped logits, scaled embeddings;
- the q/k/v biases (Qwen2) and per-head q/k norms (Qwen3, Gemma 3) in the rope kernel and
  the biases in the fused qkv product;
- sliding windows in every attention kernel: prefill (a window edge inside a tile, chunks
  after cached tokens), CUDA-core decode with host and device splits, clusters, the
  tensor-core decode, the scalar kernel; soft-capped scores (scalar kernel); head_dim 256.
Tolerances are docs/ARCHITECTURE.md's "Correctness bars". Needs CuPy and a CUDA GPU."""
from __future__ import annotations

import os

import numpy as np
import pytest
from test_cuda_graphs import (BLOCK_SIZE, EAGER_TOLERANCE, MAX_MODEL_LEN, REFERENCE_TOLERANCE,
                              Sequences, assert_kv_written_by, assert_logits_close)
from test_cuda_ops import (DECODE, MIXED_PREFILL, PREFILL_VARIANTS, REF, TILE_EDGES,
                           _gpu_available, assert_close, build_attention_case, poisoned,
                           random_bf16, rope_table, run_ops_attention, run_paged_attention,
                           to_float)

from cupy_llama.backends.numpy_ops import normed
from cupy_llama.bf16 import bf16_bits_to_float32, round_to_bf16
from cupy_llama.interface import HeadNorm
from cupy_llama.util import cdiv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------- row kernels

@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [64, 1152, 90, 5376])  # 5376: more than a group a thread
def test_rms_norm_offset_and_the_norm_that_adds(cp, rng, hidden, offset):
    from cupy_llama.backends.cuda import elementwise
    x = rng.standard_normal((17, hidden), dtype=np.float32) * 3
    w_bits, w = random_bf16(rng, (hidden,), scale=0.5)
    expected = np.empty_like(x)
    REF.rms_norm(x, w, 1e-6, expected, offset=offset)
    out = poisoned(cp, x.shape)
    elementwise.rms_norm(cp.asarray(x), cp.asarray(w_bits), 1e-6, out, offset)
    assert_close(to_float(cp, out), expected, 1e-2, 1e-2, f"rms_norm offset {offset}")
    x_bits, x16 = random_bf16(rng, (17, hidden), scale=3.0)
    residual = rng.standard_normal((17, hidden), dtype=np.float32)
    expected = residual.copy()
    REF.add_rms_norm(x16, w, 1e-6, expected, offset=offset)
    got = cp.asarray(residual)
    elementwise.add_rms_norm(cp.asarray(x_bits), cp.asarray(w_bits), 1e-6, got, offset)
    assert_close(cp.asnumpy(got), expected, 1e-4, 1e-4, f"add_rms_norm offset {offset}")
    # into another buffer: the same bits there, the residual as it was
    kept, out = cp.asarray(residual), poisoned(cp, residual.shape, np.float32)
    elementwise.add_rms_norm(cp.asarray(x_bits), cp.asarray(w_bits), 1e-6, kept, offset, out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(got))
    np.testing.assert_array_equal(cp.asnumpy(kept), residual)


@pytest.mark.parametrize("shape", [(1, 64), (17, 6912), (5, 100)])
def test_gelu_tanh_and_mul(cp, rng, shape):
    from cupy_llama.backends.cuda import elementwise
    bits, values = random_bf16(rng, (shape[0], 2 * shape[1]), scale=2.0)
    expected = np.empty(shape, np.float32)
    REF.act_and_mul(values, expected, "gelu_tanh")
    out = poisoned(cp, shape)
    elementwise.act_and_mul(cp.asarray(bits), out, "gelu_tanh")
    assert_close(to_float(cp, out), expected, 1e-3, 1.6e-2, "gelu_tanh_and_mul")


def test_softcap_and_scaled_embedding(cp, rng):
    from cupy_llama.backends.cuda import elementwise
    logits = rng.standard_normal((3, 1001), dtype=np.float32) * 40
    expected = logits.copy()
    REF.softcap(expected, 30.0)
    got = cp.asarray(logits)
    elementwise.softcap(got, 30.0)
    assert_close(cp.asnumpy(got), expected, 1e-5, 1e-5, "softcap")
    table_bits, table = random_bf16(rng, (300, 64))
    ids = rng.integers(0, 300, 9).astype(np.int32)
    expected = np.empty((9, 64), np.float32)
    REF.embedding(ids, table, expected, scale=34.0)
    out = cp.full((9, 64), np.nan, np.float32)
    elementwise.embedding(cp.asarray(ids), cp.asarray(table_bits), out, scale=34.0)
    np.testing.assert_array_equal(cp.asnumpy(out), expected)  # x * 34 is exact in float32


# -------------------------------------------------------------- biases and head norms

@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 16])
@pytest.mark.parametrize("what", ["bias", "norm", "both"])
def test_rope_with_biases_and_head_norms(cp, rng, what, head_dim, offset):
    check_rope(cp, rng, what, 8, 2, head_dim, 37, offset)


# (num_heads, num_kv_heads, head_dim, num_tokens): the head-norm kernel's blocks of
# HEAD_NORM_WARPS q and k heads, all full (Qwen3-0.6B: 24 heads, 3 blocks; 40 heads, 5) or
# one partial (Gemma-3-1B: 5 heads; 3 heads), at one token (a batch-1 decode step, with and
# without a slot) and at several
HEAD_NORM_SHAPES = [(16, 8, 128, 1), (4, 1, 256, 1), (16, 8, 128, 6), (4, 1, 256, 19),
                    (32, 8, 64, 3), (2, 1, 128, 2)]


@pytest.mark.parametrize("shape", HEAD_NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_head_norm_rope_across_blocks_of_heads(cp, rng, shape):
    num_heads, num_kv_heads, head_dim, num_tokens = shape
    for what, offset, padded in (("norm", 1.0, slice(1, None, 2)), ("both", 0.0, slice(0, None, 2))):
        check_rope(cp, rng, what, num_heads, num_kv_heads, head_dim, num_tokens, offset, padded)


def check_rope(cp, rng, what, num_heads, num_kv_heads, head_dim, num_tokens, offset,
               padded=slice(0, None, 7)):
    """rope_and_cache with biases ("bias"), head norms ("norm") or both against the
    reference; the tokens slots[padded] have no slot (padding: no KV written)."""
    from cupy_llama.backends.cuda import elementwise
    num_blocks = cdiv(num_tokens, BLOCK_SIZE) + 1
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv_bits, qkv = random_bf16(rng, (num_tokens, width), scale=2.0)
    bias_bits, bias = random_bf16(rng, (width,), scale=0.5)
    q_bits, q_w = random_bf16(rng, (head_dim,), scale=0.3)
    k_bits, k_w = random_bf16(rng, (head_dim,), scale=0.3)
    use_bias, use_norm = what in ("bias", "both"), what in ("norm", "both")
    positions = rng.integers(0, 4096, num_tokens).astype(np.int32)
    slots = rng.choice(num_blocks * BLOCK_SIZE, num_tokens, replace=False).astype(np.int32)
    slots[padded] = -1
    cos_sin = rope_table(4096, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    class Meta:
        def __init__(self, keep):
            self.positions, self.slot_mapping = positions[keep], slots[keep]

    written = slots >= 0
    # the kernel's rounding points (rope.cu): a biased value and a normed one are bf16
    # before the rotation, so the reference rounds there too and the tolerance is left
    # with the output's own rounding (unrounded, a normed value near 8 alone differs by
    # up to 0.016 before it is rotated)
    ref_qkv = round_to_bf16(qkv + bias) if use_bias else qkv.copy()
    if use_norm:
        q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        for start, stop, weight in ((0, q_end, q_w), (q_end, k_end, k_w)):
            heads = ref_qkv[:, start:stop].reshape(num_tokens, -1, head_dim)
            ref_qkv[:, start:stop] = round_to_bf16(
                normed(heads, weight, 1e-6, offset)).reshape(num_tokens, stop - start)
    q_ref = np.empty((num_tokens, num_heads, head_dim), np.float32)
    scratch = np.empty(cache_shape, np.float32)
    REF.rope_and_cache(ref_qkv, Meta(np.ones(num_tokens, bool)), cos_sin, scratch,
                       scratch.copy(), q_ref)
    k_ref = np.full(cache_shape, np.nan, np.float32)
    v_ref = np.full(cache_shape, np.nan, np.float32)
    REF.rope_and_cache(ref_qkv[written], Meta(written), cos_sin, k_ref, v_ref,
                       np.empty((int(written.sum()), num_heads, head_dim), np.float32))
    k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
    q_out = poisoned(cp, (num_tokens, num_heads, head_dim))
    gpu_norm = (HeadNorm(cp.asarray(q_bits), cp.asarray(k_bits), 1e-6, offset)
                if use_norm else None)
    elementwise.rope_and_cache(cp.asarray(qkv_bits), cp.asarray(positions), cp.asarray(slots),
                               cp.asarray(cos_sin), k_cache, v_cache, q_out,
                               cp.asarray(bias_bits) if use_bias else None, gpu_norm)
    label = f"{what} d={head_dim} offset={offset}"
    assert_close(to_float(cp, q_out), q_ref, 2e-2, 2e-2, f"q ({label})")
    for name, got, ref in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
        got = to_float(cp, got)
        assert (np.isnan(got) == np.isnan(ref)).all(), f"{name} cache ({label}): wrong slots written"
        assert_close(np.nan_to_num(got), np.nan_to_num(ref), 2e-2, 2e-2, f"{name} cache ({label})")


def test_programmatic_row_kernels_give_the_same_bits_eager_and_in_a_graph(cp, rng):
    """The head-norm rope and the adding norm launched programmatically, each right after
    a programmatic product that writes what it reads (and before one that reads what it
    writes), give the bits of plain launches, eagerly and replayed from a CUDA graph: a
    Qwen3-0.6B-shaped layer's chain, three times over."""
    from cupy_llama.backends.cuda import elementwise, gemm, launch
    if not launch.launch_attributes_usable():
        pytest.skip("programmatic launches need cuLaunchKernelEx and an sm_90+ GPU")
    num_tokens, hidden, num_heads, num_kv_heads, head_dim, num_blocks = 2, 1024, 16, 8, 128, 4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    weights = [cp.asarray(random_bf16(rng, shape, scale=scale)[0]) for shape, scale in (
        ((hidden,), 0.3), ((width, hidden), 0.03), ((hidden, num_heads * head_dim), 0.03),
        ((hidden,), 0.3), ((head_dim,), 0.3), ((head_dim,), 0.3))]
    input_norm, w_qkv, w_o, out_norm, q_norm, k_norm = weights
    head_norm = HeadNorm(q_norm, k_norm, 1e-6, 1.0)
    positions = cp.asarray(rng.integers(0, 4096, num_tokens).astype(np.int32))
    slots = cp.asarray(rng.choice(num_blocks * BLOCK_SIZE, num_tokens, replace=False).astype(np.int32))
    cos_sin = cp.asarray(rope_table(4096, head_dim))
    start = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    def run(programmatic, capture):
        products = gemm.Products("mma", programmatic=programmatic)
        residual = cp.asarray(start)
        qkv = cp.empty((num_tokens, width), np.uint16)
        q_out = poisoned(cp, (num_tokens, num_heads, head_dim))
        h = cp.empty((num_tokens, hidden), np.uint16)
        k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)

        def chain():
            for _ in range(3):
                assert products.norm_linear(residual, input_norm, 1e-6, w_qkv, qkv, 1.0)
                elementwise.rope_and_cache(qkv, positions, slots, cos_sin, k_cache, v_cache,
                                           q_out, None, head_norm, programmatic)
                products.linear(q_out.reshape(num_tokens, -1), w_o, h)
                elementwise.add_rms_norm(h, out_norm, 1e-6, residual, 1.0, programmatic)

        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            if capture:
                stream.begin_capture()
                chain()
                stream.end_capture().launch(stream)
            else:
                chain()
            stream.synchronize()
        return [cp.asnumpy(a) for a in (residual, k_cache, v_cache)]

    reference = run(False, False)
    assert np.isfinite(reference[0]).all()
    for programmatic, capture in ((True, False), (False, True), (True, True)):
        for name, got, expected in zip(("residual", "k cache", "v cache"),
                                       run(programmatic, capture), reference):
            np.testing.assert_array_equal(got, expected, err_msg=(
                f"{name}: programmatic={programmatic} graph={capture} differs from plain"))


@pytest.mark.parametrize("m", [1, 7, 16])
def test_fused_products_take_offsets_gelu_and_biases(cp, rng, m):
    """The skinny kernels' norm prologue with Gemma's offset, the GeGLU epilogue and the qkv
    epilogue with biases, against the composed NumPy ops."""
    from cupy_llama.backends.cuda import gemm
    products = gemm.Products("mma", programmatic=False)
    k, inter = 1152, 512
    x = rng.standard_normal((m, k), dtype=np.float32)
    norm_bits, norm_w = random_bf16(rng, (k,), scale=0.3)
    w_bits, w = random_bf16(rng, (2 * inter, k), scale=0.03)
    h = np.empty((m, k), np.float32)
    REF.rms_norm(x, norm_w, 1e-6, h, offset=1.0)
    h = np.asarray(h)
    gate_up = h @ w.T
    expected = np.empty((m, inter), np.float32)
    REF.act_and_mul(gate_up, expected, "gelu_tanh")
    out = poisoned(cp, (m, inter))
    assert products.norm_gate_up_act(cp.asarray(x), cp.asarray(norm_bits), 1e-6, cp.asarray(w_bits),
                                     out, 1.0, "gelu_tanh"), "not fused"
    got = to_float(cp, out)
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < 2e-2, f"norm_gate_up_act gelu m={m}: relative error {rel:.3g}"

    head_dim, num_heads, num_kv_heads, num_blocks = 128, 8, 2, 8
    n = (num_heads + 2 * num_kv_heads) * head_dim
    qkv_bits, qkv_w = random_bf16(rng, (n, k), scale=0.03)
    bias_bits, bias = random_bf16(rng, (n,), scale=0.5)
    positions = rng.integers(0, 2048, m).astype(np.int32)
    slots = rng.choice(num_blocks * BLOCK_SIZE, m, replace=False).astype(np.int32)
    cos_sin = rope_table(2048, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    class Meta:
        pass

    meta = Meta()
    meta.positions, meta.slot_mapping = positions, slots
    q_ref = np.empty((m, num_heads, head_dim), np.float32)
    k_ref, v_ref = np.full(cache_shape, np.nan, np.float32), np.full(cache_shape, np.nan, np.float32)
    REF.rope_and_cache(h @ qkv_w.T, meta, cos_sin, k_ref, v_ref, q_ref, bias=bias)
    q_out = poisoned(cp, q_ref.shape)
    k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
    assert products.norm_qkv_rope(cp.asarray(x), cp.asarray(norm_bits), 1e-6, cp.asarray(qkv_bits),
                                  cp.asarray(positions), cp.asarray(slots), cp.asarray(cos_sin),
                                  k_cache, v_cache, q_out, 1.0, cp.asarray(bias_bits)), "not fused"
    assert_close(to_float(cp, q_out), q_ref, 3e-2, 3e-2, f"fused qkv with bias m={m}")
    got_k = to_float(cp, k_cache)
    assert (np.isnan(got_k) == np.isnan(k_ref)).all()
    assert_close(np.nan_to_num(got_k), np.nan_to_num(k_ref), 3e-2, 3e-2, f"fused k cache m={m}")
    assert_close(np.nan_to_num(to_float(cp, v_cache)), np.nan_to_num(v_ref), 3e-2, 3e-2,
                 f"fused v cache m={m}")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m, k", [(1, 1152), (2, 1152), (1, 2304), (5, 512)])
def test_fused_products_add_the_sublayer_before(cp, rng, m, k, fp8):
    """Gemma's sandwich norms inside the normed skinny products (PRO_ADD_NORM): the output of
    the sublayer before joins x through its own norm (interface.AddedNorm), the kernel
    writes the sum and norms it for its product; each epilogue, bf16 and FP8 weights,
    against the NumPy ops. x stays as it was, and a second launch gives the same bits."""
    from cupy_llama.backends.cuda import gemm
    from cupy_llama.interface import AddedNorm
    from test_cuda_fp8 import fp8_weight, reference_product
    assert gemm.fuses_added(m, k)
    products = gemm.Products("mma", programmatic=False)
    eps, offset, inter = 1e-6, 1.0, 256
    x = rng.standard_normal((m, k), dtype=np.float32) * 2
    h_bits, h = random_bf16(rng, (m, k), scale=3.0)
    added_bits, added_w = random_bf16(rng, (k,), scale=0.3)
    norm_bits, norm_w = random_bf16(rng, (k,), scale=0.3)
    joined = x.copy()
    REF.add_rms_norm(h, added_w, eps, joined, offset=offset)
    normed_joined = round_to_bf16(normed(joined, norm_w, eps, offset))

    def weight_of(n):
        if fp8:
            weight, values, scale = fp8_weight(cp, rng, n, k)
            return weight, lambda a: reference_product(a, values, scale).astype(np.float32)
        bits, values = random_bf16(rng, (n, k), scale=0.03)
        return cp.asarray(bits), lambda a: a @ values.T

    x_gpu, h_gpu = cp.asarray(x), cp.asarray(h_bits)
    added_w_gpu, norm_gpu = cp.asarray(added_bits), cp.asarray(norm_bits)

    def launch(product, *args):
        """The sum and the product's outputs of two launches, which must agree bit for bit."""
        runs = []
        for _ in range(2):
            out = poisoned(cp, (m, k), np.float32)
            outputs = product(AddedNorm(h_gpu, added_w_gpu, out), *args)
            runs.append([cp.asnumpy(a) for a in (out, *outputs)])
        for first, second in zip(*runs):
            np.testing.assert_array_equal(first, second, err_msg="two launches differ")
        np.testing.assert_array_equal(cp.asnumpy(x_gpu), x, err_msg="the kernel wrote x")
        assert_close(runs[0][0], joined, 1e-5, 1e-5, f"the joined stream, {m} x {k}")
        return runs[0][1:]

    weight, reference = weight_of(2 * inter)

    def linear(added):
        out = poisoned(cp, (m, 2 * inter), np.float32)
        assert products.norm_linear(x_gpu, norm_gpu, eps, weight, out, offset, added), "not fused"
        return [out]

    (got,) = launch(linear)
    assert_close(got, reference(normed_joined), 2e-2, 2e-2, f"norm_linear, {m} x {k}")

    def gate_up_act(added):
        out = poisoned(cp, (m, inter))
        assert products.norm_gate_up_act(x_gpu, norm_gpu, eps, weight, out, offset,
                                         "gelu_tanh", added), "not fused"
        return [out]

    (got,) = launch(gate_up_act)
    expected = np.empty((m, inter), np.float32)
    REF.act_and_mul(round_to_bf16(reference(normed_joined)), expected, "gelu_tanh")
    rel = np.linalg.norm(bf16_bits_to_float32(got) - expected) / np.linalg.norm(expected)
    assert rel < 2e-2, f"norm_gate_up_act, {m} x {k}: relative error {rel:.3g}"

    head_dim, num_heads, num_kv_heads, num_blocks = 128, 4, 1, 4
    weight, reference = weight_of((num_heads + 2 * num_kv_heads) * head_dim)
    positions = rng.integers(0, 2048, m).astype(np.int32)
    slots = rng.choice(num_blocks * BLOCK_SIZE, m, replace=False).astype(np.int32)
    cos_sin = rope_table(2048, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    def qkv_rope(added):
        q_out = poisoned(cp, (m, num_heads, head_dim))
        k_cache, v_cache = poisoned(cp, cache_shape), poisoned(cp, cache_shape)
        assert products.norm_qkv_rope(x_gpu, norm_gpu, eps, weight, cp.asarray(positions),
                                      cp.asarray(slots), cp.asarray(cos_sin), k_cache, v_cache,
                                      q_out, offset, None, added), "not fused"
        return [q_out, k_cache, v_cache]

    q_out, k_cache, v_cache = launch(qkv_rope)

    class Meta:
        pass

    meta = Meta()
    meta.positions, meta.slot_mapping = positions, slots
    q_ref = np.empty((m, num_heads, head_dim), np.float32)
    k_ref, v_ref = np.full(cache_shape, np.nan, np.float32), np.full(cache_shape, np.nan, np.float32)
    REF.rope_and_cache(reference(normed_joined), meta, cos_sin, k_ref, v_ref, q_ref)
    assert_close(bf16_bits_to_float32(q_out), q_ref, 3e-2, 3e-2, f"q, {m} x {k}")
    for name, got, expected in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
        got = bf16_bits_to_float32(got)
        assert (np.isnan(got) == np.isnan(expected)).all(), f"{name} cache: slots written"
        assert_close(np.nan_to_num(got), np.nan_to_num(expected), 3e-2, 3e-2, f"{name} cache")


def test_the_ops_add_the_sublayer_before_where_no_kernel_can(cp, rng):
    """Where the skinny kernels cannot take the add (rows too long for one batch of loads,
    or a prefill step), the CUDA ops add it with add_rms_norm first: the same sum, and the
    product of its norm."""
    from cupy_llama.backends.cuda import gemm
    from cupy_llama.backends.cuda.ops import CudaOps
    from cupy_llama.backends.cuda.switches import KernelSwitches
    from cupy_llama.interface import AddedNorm
    eps, offset, n = 1e-6, 1.0, 256
    for m, k in ((3, 1152), (9, 1152), (16, 1152), (17, 1152), (2, 2304)):
        assert not gemm.fuses_added(m, k)
        x = rng.standard_normal((m, k), dtype=np.float32)
        h_bits, h = random_bf16(rng, (m, k), scale=3.0)
        added_bits, added_w = random_bf16(rng, (k,), scale=0.3)
        norm_bits, norm_w = random_bf16(rng, (k,), scale=0.3)
        w_bits, w = random_bf16(rng, (n, k), scale=0.03)
        joined = x.copy()
        REF.add_rms_norm(h, added_w, eps, joined, offset=offset)
        out, summed = poisoned(cp, (m, n), np.float32), poisoned(cp, (m, k), np.float32)
        scratch = cp.empty((m, k), np.uint16)
        ops = CudaOps(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=1, num_heads=1,
                      head_dim=64, max_model_len=16,
                      switches=KernelSwitches(skinny_gemm="mma", programmatic=False))
        ops.norm_linear(cp.asarray(x), cp.asarray(norm_bits), eps, cp.asarray(w_bits), out,
                        scratch, offset=offset,
                        added=AddedNorm(cp.asarray(h_bits), cp.asarray(added_bits), summed))
        assert_close(cp.asnumpy(summed), joined, 1e-5, 1e-5, f"the joined stream, {m} x {k}")
        expected = round_to_bf16(normed(joined, norm_w, eps, offset)) @ w.T
        assert_close(cp.asnumpy(out), expected, 2e-2, 2e-2, f"norm_linear, {m} x {k}")


# ---------------------------------------------------------------- sliding windows

# windows shorter and longer than the contexts, one inside a prefill tile, one a key
WINDOWS = [1, 40, 100, 512, 4096]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_attention_with_a_window(cp, rng, head_dim, window):
    for seqs in (MIXED_PREFILL, TILE_EDGES):
        case = build_attention_case(cp, rng, seqs, 2, head_dim, 4, window=window)
        for d, tiles in PREFILL_VARIANTS:
            if d == head_dim:
                got = run_paged_attention(cp, case, head_dim, prefill_tiles=tiles)
                assert_close(got, case["expected"], 1.5e-2, 1e-2,
                             f"prefill d={head_dim} t={tiles} window={window}")
        got = run_paged_attention(cp, case, head_dim, kernel="scalar")
        assert_close(got, case["expected"], 1.5e-2, 1e-2, f"scalar d={head_dim} window={window}")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_attention_with_a_window(cp, rng, head_dim, window):
    """Every decode kernel: CUDA cores with host and device split lengths, clusters (host and
    device lengths), tensor cores, the scalar kernel, and through CudaOps (which picks the
    splits from the window)."""
    from cupy_llama.backends.cuda import launch
    group = 4
    case = build_attention_case(cp, rng, DECODE, 2, head_dim, group, window=window)
    kernels = ["decode", "scalar"] + (["decode_mma"] if head_dim != 256 else [])
    for kernel in kernels:
        for num_splits in (1, 3, 32):
            for max_seq_len in ("batch", None):
                got = run_paged_attention(cp, case, head_dim, num_splits=num_splits,
                                          max_seq_len=max_seq_len, kernel=kernel)
                assert_close(got, case["expected"], 1.5e-2, 1e-2,
                             f"{kernel} d={head_dim} window={window} splits={num_splits} {max_seq_len}")
    if launch.launch_attributes_usable():
        for max_seq_len in ("batch", None):
            got = run_paged_attention(cp, case, head_dim, num_splits=32, clusters=True,
                                      max_seq_len=max_seq_len)
            assert_close(got, case["expected"], 1.5e-2, 1e-2,
                         f"clusters d={head_dim} window={window} {max_seq_len}")
    assert_close(run_ops_attention(cp, case, head_dim), case["expected"], 1.5e-2, 1e-2,
                 f"CudaOps d={head_dim} window={window}")


# (head_dim, kv heads, group): Qwen3-0.6B and 4B, Gemma 3 1B and 4B, and a group of 8
# that two CTAs share out (head parts)
HEAD_NORM_DECODE_SHAPES = [(128, 2, 2), (128, 2, 4), (256, 1, 4), (256, 2, 2), (128, 1, 8)]


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("head_dim, num_kv_heads, group", HEAD_NORM_DECODE_SHAPES)
def test_decode_attention_norms_and_rotates_as_the_rope_kernel_does(cp, rng, head_dim,
                                                                  num_kv_heads, group, window):
    """The decode kernels' head-norm forms (attention.DecodeRope) against the rope kernel
    followed by the plain decode kernel, on the same inputs: the same bits in the output
    and in both caches (the new token's key and value written once, every other slot left
    as it was), for one range, host and device split lengths, and clusters; a sequence
    whose only key is the new one, splits that end before it, and a token without a cache
    slot (the recomputed last token of a cached prompt: its key and value come from the
    cache, whatever the product gave) among them."""
    from cupy_llama.backends.cuda import attention, elementwise, launch
    seqs = [(0, 1), (16, 1), (127, 1), (1327, 1), (255, 1), (2047, 1), (300, 1)]
    case = build_attention_case(cp, rng, seqs, num_kv_heads, head_dim, group, window=window)
    batch = case["gpu_batch"]
    num_heads, num_tokens = case["num_heads"], batch.num_tokens
    positions = batch.positions  # the new token's, seq_len - 1
    slots = np.array([batch.block_tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for b, p in enumerate(positions)], np.int32)
    slots[-1] = -1
    qkv = cp.asarray(random_bf16(rng, (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim),
                                 scale=2.0)[0])
    norm = HeadNorm(cp.asarray(random_bf16(rng, (head_dim,), 0.3)[0]),
                    cp.asarray(random_bf16(rng, (head_dim,), 0.3)[0]), 1e-6, 1.0)
    rope = attention.DecodeRope(qkv, norm, cp.asarray(rope_table(4096, head_dim)),
                                cp.asarray(positions), cp.asarray(slots))
    runs = [dict(num_splits=1), dict(num_splits=3), dict(num_splits=3, max_seq_len=None),
            dict(num_splits=32, max_seq_len=None)]
    if launch.launch_attributes_usable():
        runs += [dict(num_splits=32, clusters=True),
                 dict(num_splits=32, clusters=True, max_seq_len=None)]

    def attend(fused, num_splits, max_seq_len=batch.max_seq_len, clusters=False):
        k_cache, v_cache = case["k_gpu"].copy(), case["v_gpu"].copy()
        q = poisoned(cp, (num_tokens, num_heads, head_dim))
        if not fused:
            elementwise.rope_and_cache(qkv, rope.positions, rope.slot_mapping, rope.cos_sin,
                                       k_cache, v_cache, q, None, norm)
        out = poisoned(cp, case["expected"].shape)
        parts = batch.num_seqs * num_heads * num_splits
        ran_fused = attention.paged_attention(
            q, k_cache, v_cache, cp.asarray(batch.block_tables), cp.asarray(batch.seq_lens),
            cp.asarray(batch.query_start_loc), out, scale=head_dim ** -0.5, max_query_len=1,
            max_seq_len=max_seq_len, num_splits=num_splits,
            partial_out=poisoned(cp, parts * head_dim, np.float32),
            partial_lse=poisoned(cp, parts, np.float32), clusters=clusters, window=window,
            kernel="decode", rope=rope if fused else None)
        assert ran_fused == fused
        return [cp.asnumpy(a) for a in (out, k_cache, v_cache)]

    for run in runs:
        expected = attend(False, **run)
        assert np.isfinite(bf16_bits_to_float32(expected[0])).all()
        for name, got, want in zip(("output", "k cache", "v cache"), attend(True, **run), expected):
            np.testing.assert_array_equal(got, want, err_msg=(
                f"{name} of the head-norm decode d={head_dim} kv={num_kv_heads} group={group} "
                f"window={window} {run} differs from the rope kernel then decode"))


@pytest.mark.parametrize("seqs", [MIXED_PREFILL, DECODE], ids=["prefill", "decode"])
def test_soft_capped_scores(cp, rng, seqs):
    """Gemma 2's capped scores take the scalar kernel, whichever kernel the shape would
    take, with and without a window; large scores so the cap matters."""
    for window in (None, 100):
        case = build_attention_case(cp, rng, seqs, 2, 64, 4, q_scale=8.0, window=window,
                                    softcap=20.0)
        got = run_paged_attention(cp, case, 64, num_splits=3 if seqs is DECODE else 1)
        assert_close(got, case["expected"], 1.5e-2, 1e-2, f"softcap window={window}")


def test_head_dim_256_prefill_and_decode_through_ops(cp, rng):
    case = build_attention_case(cp, rng, MIXED_PREFILL, 1, 256, 4, window=512)
    assert_close(run_ops_attention(cp, case, 256), case["expected"], 1.5e-2, 1e-2, "d256 prefill")
    case = build_attention_case(cp, rng, [(int(n), 1) for n in rng.integers(0, 3000, 12)], 1,
                                256, 4)
    assert_close(run_ops_attention(cp, case, 256), case["expected"], 1.5e-2, 1e-2, "d256 decode")


# -------------------------------------------------------------------- whole models

# tiny random models of each family, with the fast kernels' head dims and windows the
# prompts outgrow
FAMILIES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"],
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=128, use_sliding_window=True,
                  sliding_window=100, max_window_layers=1),
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=100),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], head_dim=128, query_pre_attn_scalar=128,
                   sliding_window=100, sliding_window_pattern=2),
    "gemma3-d256": dict(architectures=["Gemma3ForCausalLM"], head_dim=256, num_attention_heads=4,
                        num_key_value_heads=1, query_pre_attn_scalar=256, sliding_window=100,
                        sliding_window_pattern=2),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=64,
                   sliding_window=100, attn_logit_softcapping=20.0, final_logit_softcapping=15.0),
}
NUM_SEQS = 8
NUM_KV_BLOCKS = NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from cupy_llama.bench.random_model import make_random_model
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    shape = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=1000, tie_word_embeddings=False)
    directory = make_random_model(tmp_path_factory.mktemp(request.param) / "model", "tiny",
                                  seed=0, **{**shape, **FAMILIES[request.param]})
    config = read_config(directory)
    return request.param, model_for(config), open_checkpoint(directory, model_for(config))


def make_backends(family, skinny="auto"):
    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.backends.cuda.backend import CudaBackend
    from cupy_llama.backends.cuda.switches import KernelSwitches
    _, model, checkpoint = family
    cpu = CpuBackend(model, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                     block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    gpu = CudaBackend(model, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                      max_num_batched_tokens=256, block_size=BLOCK_SIZE,
                      num_kv_blocks=NUM_KV_BLOCKS, switches=KernelSwitches(skinny_gemm=skinny))
    return cpu, gpu


@pytest.mark.parametrize("skinny", ["auto", "cublas"])
def test_family_on_the_gpu_matches_the_cpu(family, rng, skinny):
    """Prefill chunks of up to 80 tokens (step graphs; the window edge inside chunks),
    then decode rounds of 1 to 8 sequences (decode graphs, contexts past the window),
    each step against the eager pass and the CPU reference; padding rows write no KV."""
    import cupy
    name, model, _ = family
    cpu, gpu = make_backends(family, skinny)
    assert gpu.graphs is not None, f"graphs are off: {gpu.graphs_off_reason}"
    lengths = [700, 37, 250, 16, 130, 1, 420, 90]
    seqs = Sequences([rng.integers(0, 1000, n) for n in lengths], NUM_KV_BLOCKS, rng)
    while True:
        counts = {b: min(80, len(t) - 1 - seqs.computed[b]) for b, t in enumerate(seqs.tokens)}
        counts = dict([(b, n) for b, n in counts.items() if n > 0][:3])
        if not counts:
            break
        batch = seqs.batch(counts)
        expected = cpu.forward(batch)
        got = cupy.asnumpy(gpu.forward(batch))
        assert_logits_close(got, expected, REFERENCE_TOLERANCE, f"{name}/{skinny}: prefill {counts}")
        seqs.advance(counts)
    for members in ([0], [1, 2, 3], list(range(NUM_SEQS)), [4, 6]):
        for step in range(3):
            counts = {b: 1 for b in members}
            batch = seqs.batch(counts)
            what = f"{name}/{skinny}: decode of {len(members)}, step {step}"
            expected = cpu.forward(batch)
            replayed = cupy.asnumpy(gpu.forward(batch))
            eager = cupy.asnumpy(gpu.model.forward(gpu, batch))  # rewrites the same KV
            assert_logits_close(replayed, eager, EAGER_TOLERANCE, f"{what}: graph vs eager")
            assert_logits_close(replayed, expected, REFERENCE_TOLERANCE, f"{what}: graph vs CPU")
            seqs.advance(counts, np.argmax(expected, axis=-1))
    assert_kv_written_by(gpu, seqs)
    gpu.close()
