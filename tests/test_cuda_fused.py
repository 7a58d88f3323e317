"""The fused skinny kernels of gemv.cu (norm before the product; SiLU-and-mul, RoPE and the
KV-cache write, or the residual add after it) against the float32 NumPy reference ops
composed the same way, on bf16-rounded inputs; and programmatic launches against plain
ones. Needs CuPy and a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from test_cuda_ops import (BLOCK_SIZE, REF, _gpu_available, assert_close, poisoned,
                           random_bf16, rope_table, to_float)
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
    if not launch.launch_attributes_usable():
        pytest.skip("programmatic launches need cuLaunchKernelEx and an sm_90+ GPU")
    k, n = 2048, 2048
    norm_bits, _ = random_bf16(rng, (k,))
    w_bits, _ = random_bf16(rng, (n, k), scale=0.02)
    up_bits, _ = random_bf16(rng, (2 * n, k), scale=0.02)
    norm_w, w, up = cp.asarray(norm_bits), cp.asarray(w_bits), cp.asarray(up_bits)
    start = _residual(rng, 4, k)

    def chain(residual, act):
        for _ in range(3):
            assert gemm.norm_gate_up_silu(residual, norm_w, EPS, up, act), "not fused"
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


# the MLP in one kernel (gemm.norm_mlp): (hidden, intermediate) of Llama-3.2-1B, of a block
# slice of one chunk, of fewer SiLU tiles than SMs, and of a hidden size of one output tile
MLP_SHAPES = [(2048, 8192), (256, 1000), (64, 24), (16, 40)]


def _mlp_operands(cp, rng, k, inter, m):
    norm_bits, _ = random_bf16(rng, (k,))
    gate_up_bits, _ = random_bf16(rng, (2 * inter, k), scale=0.05)
    down_bits, _ = random_bf16(rng, (k, inter), scale=0.05)
    start = _residual(rng, m, k)
    return cp.asarray(norm_bits), cp.asarray(gate_up_bits), cp.asarray(down_bits), start


def _mlp_workspace(cp, k):
    from cupy_llama.backends.cuda import gemm
    sums, arrivals = gemm.mlp_workspace_sizes(k)
    return cp.zeros(sums, np.int64), cp.zeros(arrivals, np.uint32)


def _composed_mlp(cp, residual, norm_w, gate_up, down):
    """The two fused kernels the MLP is otherwise: norm + gate/up + SiLU, then down added."""
    from cupy_llama.backends.cuda import gemm
    act = cp.empty((residual.shape[0], down.shape[1]), np.uint16)
    assert gemm.norm_gate_up_silu(residual, norm_w, EPS, gate_up, act), "not fused"
    gemm.linear(act, down, residual, accumulate=True)
    return act


@pytest.mark.parametrize("m", (1, 2, 7, 8))
@pytest.mark.parametrize("k,inter", MLP_SHAPES)
def test_fused_mlp_matches_the_two_kernels(cp, rng, k, inter, m, skinny_mma):
    """The one-kernel MLP adds what the two kernels add, up to the order of down's fp32
    sums, and what float64 NumPy makes of the two kernels' SiLU values; it leaves its
    counters at zero."""
    from cupy_llama.backends.cuda import gemm
    norm_w, gate_up, down, start = _mlp_operands(cp, rng, k, inter, m)
    sums, arrivals = _mlp_workspace(cp, k)
    fused = cp.asarray(start)
    assert gemm.norm_mlp(fused, norm_w, EPS, gate_up, down, sums, arrivals), "not fused"
    composed = cp.asarray(start)
    act = _composed_mlp(cp, composed, norm_w, gate_up, down)
    added, expected = cp.asnumpy(fused) - start, cp.asnumpy(composed) - start
    assert _relative_error(added, expected) < 1e-4, f"m={m} [{k}] x [{inter}]: differs from the two kernels"
    reference = to_float(cp, act).astype(np.float64) @ to_float(cp, down).T.astype(np.float64)
    assert _relative_error(added, reference) < 1e-3
    normed = _normed(start, to_float(cp, norm_w))
    gate_up_ref = normed.astype(np.float64) @ to_float(cp, gate_up).T.astype(np.float64)
    assert _relative_error(to_float(cp, act), (gate_up_ref[:, :inter] / (1 + np.exp(-gate_up_ref[:, :inter]))
                                               * gate_up_ref[:, inter:])) < 2e-2
    assert int(cp.count_nonzero(arrivals)) == 0 and int(cp.count_nonzero(sums)) == 0, "workspace left non-zero"


def test_fused_mlp_is_deterministic_eager_and_in_a_graph(cp, rng, skinny_mma):
    """The blocks' sums meet as int64 fixed point, so whichever block adds first, the result
    is the same bits every launch: eager, replayed, plain or programmatic launches."""
    from cupy_llama.backends.cuda import gemm, launch
    k, inter = 2048, 8192
    norm_w, gate_up, down, start = _mlp_operands(cp, rng, k, inter, 4)
    sums, arrivals = _mlp_workspace(cp, k)

    def chain(residual):
        for _ in range(3):
            assert gemm.norm_mlp(residual, norm_w, EPS, gate_up, down, sums, arrivals)

    results = {}
    previous = launch.programmatic()
    try:
        for on in (False, True) if launch.launch_attributes_usable() else (False,):
            launch.set_programmatic(on)
            for run in range(3):
                residual = cp.asarray(start)
                chain(residual)
                results[("eager", on, run)] = cp.asnumpy(residual)
            stream = cp.cuda.Stream(non_blocking=True)
            residual = cp.asarray(start)
            with stream:
                stream.begin_capture()
                chain(residual)
                graph = stream.end_capture()
            for run in range(2):
                residual[...] = cp.asarray(start)
                graph.launch(stream)
                stream.synchronize()
                results[("graph", on, run)] = cp.asnumpy(residual)
    finally:
        launch.set_programmatic(previous)
    reference = results[("eager", False, 0)]
    assert not np.isnan(reference).any()
    assert not np.array_equal(reference, start)
    for key, value in results.items():
        np.testing.assert_array_equal(value, reference, err_msg=f"{key} differs")
    assert int(cp.count_nonzero(arrivals)) == 0


def test_fused_mlp_declines_what_it_cannot_take(cp, rng, skinny_mma):
    """More than 8 rows, no workspace, too small a workspace, a slice of more than 8 chunks
    per block, or a switch naming another kernel: nothing launched, the caller composes."""
    from cupy_llama.backends.cuda import gemm
    from cupy_llama.backends.cuda.device import device_limits
    k, inter = 64, 24
    norm_w, gate_up, down, start = _mlp_operands(cp, rng, k, inter, 9)
    sums, arrivals = _mlp_workspace(cp, k)
    residual = cp.asarray(start)
    assert not gemm.norm_mlp(residual, norm_w, EPS, gate_up, down, sums, arrivals)
    one = residual[:1]
    assert not gemm.norm_mlp(one, norm_w, EPS, gate_up, down, None, None)
    assert not gemm.norm_mlp(one, norm_w, EPS, gate_up, down, sums[:1], arrivals)
    wide = 8 * 8 * device_limits()["sms"] + 8  # one chunk more than 8 per block
    _, wide_gate_up, wide_down, _ = _mlp_operands(cp, rng, k, wide, 1)
    assert not gemm.norm_mlp(one, norm_w, EPS, wide_gate_up, wide_down, sums, arrivals)
    gemm.set_skinny_gemm("cublas")
    assert not gemm.norm_mlp(one, norm_w, EPS, gate_up, down, sums, arrivals)
    np.testing.assert_array_equal(cp.asnumpy(residual), start)


def test_cuda_ops_mlp_fused_or_composed_agree(cp, rng):
    """CudaOps.mlp with its workspace (one kernel) and without (two) add the same, within
    down's summation order; a prefill-sized step composes."""
    from cupy_llama.backends.cuda.ops import CudaOps
    k, inter = 256, 1000
    norm_w, gate_up, down, start = _mlp_operands(cp, rng, k, inter, 20)
    results = {}
    for fused in (True, False):
        ops = CudaOps(max_num_tokens=20, max_num_seqs=4, max_blocks_per_seq=4, num_heads=4,
                      head_dim=64, max_model_len=64,
                      mlp_workspace=_mlp_workspace(cp, k) if fused else None)
        for m in (3, 20):
            residual = cp.asarray(start[:m])
            act, h, raw = (cp.empty((m, inter), np.uint16), cp.empty((m, k), np.uint16),
                           cp.empty((m, 2 * inter), np.uint16))
            ops.mlp(residual, norm_w, EPS, gate_up, down, act, h, raw)
            results[(fused, m)] = cp.asnumpy(residual) - start[:m]
    for m in (3, 20):
        assert _relative_error(results[(True, m)], results[(False, m)]) < 1e-4
        assert not np.allclose(results[(True, m)], 0)


def test_fused_mlp_sums_out_of_range_give_nan(cp, rng, skinny_mma):
    """A down sum too large for the fixed-point workspace (or not finite) makes its output
    tile NaN instead of a wrong number; the other tiles are as the two kernels give them,
    and the workspace is zero again for the next launch."""
    from cupy_llama.backends.cuda import gemm
    k, inter = 256, 1000
    norm_w, gate_up, down, start = _mlp_operands(cp, rng, k, inter, 2)
    down[5, :] = int(float32_to_bf16_bits(np.float32([1e9]))[0])  # row 5: output tile 0
    sums, arrivals = _mlp_workspace(cp, k)
    fused = cp.asarray(start)
    assert gemm.norm_mlp(fused, norm_w, EPS, gate_up, down, sums, arrivals)
    composed = cp.asarray(start)
    _composed_mlp(cp, composed, norm_w, gate_up, down)
    fused, composed = cp.asnumpy(fused), cp.asnumpy(composed)
    assert np.isnan(fused[:, :16]).all(), "the out-of-range tile is not NaN"
    assert _relative_error(fused[:, 16:] - start[:, 16:], composed[:, 16:] - start[:, 16:]) < 1e-4
    assert int(cp.count_nonzero(arrivals)) == 0 and int(cp.count_nonzero(sums)) == 0
