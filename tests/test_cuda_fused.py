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

ROWS = (1, 2, 3, 5, 7, 8, 9, 16)
EPS = 1e-5


@pytest.fixture
def skinny_mma():
    """The products of a backend whose skinny switch says "mma"."""
    from cupy_llama.backends.cuda import gemm
    return gemm.Products("mma")


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
@pytest.mark.parametrize("k,n", [(2048, 2048), (8192, 2048), (3072, 1024), (200, 1001)])
def test_linear_accumulates_into_float32(cp, rng, m, k, n):
    """out += x @ w.T: the skinny kernel up to 16 rows (cuBLAS where shared memory is too
    small, and past 16 rows), cuBLAS with beta = 1 beyond."""
    from cupy_llama.backends.cuda import gemm
    x_bits, x = random_bf16(rng, (m, k))
    w_bits, w = random_bf16(rng, (n, k), scale=0.02)
    start = _residual(rng, m, n)
    out = cp.asarray(start)
    products = gemm.Products()
    products.linear(cp.asarray(x_bits), cp.asarray(w_bits), out, accumulate=True)
    added = cp.asnumpy(out).astype(np.float64) - start
    rel = _relative_error(added, x.astype(np.float64) @ w.T.astype(np.float64))
    assert rel < 1e-2, f"accumulate [{m},{k}]x[{n},{k}]^T: relative error of the update {rel:.3g}"
    with pytest.raises(ValueError, match="float32"):
        products.linear(cp.asarray(x_bits), cp.asarray(w_bits), cp.empty((m, n), np.uint16),
                        accumulate=True)


@pytest.mark.parametrize("out_dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("k,n", [(2048, 3072), (576, 49152), (64, 37)])
def test_norm_linear(cp, rng, k, n, out_dtype, skinny_mma):
    """Under "mma" the fused kernel runs (under "auto" it runs where the choice table names
    the skinny kernel for the product)."""
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (n, k), scale=0.02)
    w_dev = cp.asarray(w_bits)
    for m in ROWS:
        x = _residual(rng, m, k)
        expected = _normed(x, norm_w).astype(np.float64) @ w.T.astype(np.float64)
        out = poisoned(cp, (m, n), out_dtype)
        assert skinny_mma.norm_linear(cp.asarray(x), cp.asarray(norm_bits), EPS, w_dev, out)
        rel = _relative_error(to_float(cp, out), expected)
        assert rel < 1e-2, f"norm_linear m={m} [{k}]x[{n}]: relative error {rel:.3g}"


# (x rows, K) on both sides of where the norm prologue loads x once (a row a group of
# warps, 4 float4 a thread: 1 row of up to 4,096, 2 of 2,048, 3 or 4 of 1,024, 5 to 8 of
# 512), with K past the last 64-wide step (zero chunks staged after the row)
ONE_LOAD_EDGES = [(1, 4096), (1, 4104), (1, 200), (2, 2048), (2, 2056), (3, 1000), (4, 1024),
                  (4, 1032), (5, 512), (8, 512), (8, 520), (9, 512)]


@pytest.mark.parametrize("m,k", ONE_LOAD_EDGES)
def test_norm_prologue_at_the_edges_of_one_load(cp, rng, m, k, skinny_mma):
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (48, k), scale=0.02)
    x = _residual(rng, m, k)
    expected = _normed(x, norm_w).astype(np.float64) @ w.T.astype(np.float64)
    out = poisoned(cp, (m, 48), np.float32)
    assert skinny_mma.norm_linear(cp.asarray(x), cp.asarray(norm_bits), EPS, cp.asarray(w_bits), out)
    rel = _relative_error(to_float(cp, out), expected)
    assert rel < 1e-2, f"norm_linear m={m} [{k}]x[48]: relative error {rel:.3g}"


@pytest.mark.parametrize("k,inter", [(2048, 8192), (576, 1536), (64, 8)])
def test_norm_gate_up_act(cp, rng, k, inter, skinny_mma):
    norm_bits, norm_w = random_bf16(rng, (k,))
    w_bits, w = random_bf16(rng, (2 * inter, k), scale=0.05)
    w_dev = cp.asarray(w_bits)
    for m in ROWS:
        x = _residual(rng, m, k)
        gate_up = bf16_bits_to_float32(float32_to_bf16_bits(_normed(x, norm_w) @ w.T))
        expected = np.empty((m, inter), np.float32)
        REF.act_and_mul(gate_up, expected)
        out = poisoned(cp, (m, inter))
        assert skinny_mma.norm_gate_up_act(cp.asarray(x), cp.asarray(norm_bits), EPS, w_dev, out)
        rel = _relative_error(to_float(cp, out), expected)
        assert rel < 1e-2, f"norm_gate_up_act m={m} [{k}] -> [{inter}]: relative error {rel:.3g}"


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 32, 8), (128, 8, 2), (64, 9, 3)])
def test_norm_qkv_rope_matches_the_composed_ops(cp, rng, head_dim, num_heads, num_kv_heads,
                                                skinny_mma):
    k = 512
    w_bits, w = random_bf16(rng, ((num_heads + 2 * num_kv_heads) * head_dim, k), scale=0.05)
    check_norm_qkv_rope(cp, rng, skinny_mma, cp.asarray(w_bits), w, k, head_dim, num_heads,
                        num_kv_heads)


def check_norm_qkv_rope(cp, rng, products, weight, w, k, head_dim, num_heads, num_kv_heads,
                        rows=ROWS):
    """products.norm_qkv_rope with `weight` (on the device; w: its float32 value) against
    the composed reference ops: rotated q, and the k / v rows written at each token's slot
    (a slot of -1 writes nothing; every other cache slot stays NaN)."""
    num_blocks = 8
    norm_bits, norm_w = random_bf16(rng, (k,))
    cos_sin = rope_table(4096, head_dim)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    for m in rows:
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
        assert products.norm_qkv_rope(cp.asarray(x), cp.asarray(norm_bits), EPS, weight,
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


@pytest.mark.parametrize("cluster", [2, 4])
def test_clustered_staging_matches_staging_alone(cp, rng, cluster, monkeypatch):
    """Blocks that share the norm prologue's staging in a cluster stage what a block alone
    stages, the sums of squares added in another order (within a bf16 rounding of it), on
    grids that are and are not a multiple of the cluster. Every normed product is clustered
    here, whatever the size of its x (the launcher's own choice, staging_cluster, clusters
    fewer)."""
    from cupy_llama.backends.cuda import gemm, launch
    if not launch.launch_attributes_usable():
        pytest.skip("clusters need cuLaunchKernelEx and an sm_90+ GPU")
    monkeypatch.setattr(gemm, "staging_cluster", lambda w, pro, m_rows, k: cluster)
    for k, n in ((2048, 3072), (200, 1001), (64, 37)):
        norm_bits, norm_w = random_bf16(rng, (k,))
        w_bits, w = random_bf16(rng, (n, k), scale=0.02)
        w_dev = cp.asarray(w_bits)
        for m in (2, 5, 16):
            x = _residual(rng, m, k)
            expected = _normed(x, norm_w).astype(np.float64) @ w.T.astype(np.float64)
            outs = {}
            for clusters in (False, True):
                out = poisoned(cp, (m, n), np.float32)
                products = gemm.Products("mma", clusters=clusters)
                assert products.norm_linear(cp.asarray(x), cp.asarray(norm_bits), EPS, w_dev, out)
                outs[clusters] = to_float(cp, out)
                rel = _relative_error(outs[clusters], expected)
                assert rel < 1e-2, f"norm_linear cluster {cluster} m={m}: relative error {rel:.3g}"
            assert_close(outs[True], outs[False], 1e-2, 1e-3,
                         f"norm_linear cluster {cluster} m={m}")


def test_programmatic_launches_are_usable_from_sm_90(cp):
    """The tests below skip where launch attributes are unusable; on a GPU that has them
    (sm_90 and newer) that would hide a broken launcher, so it fails here instead."""
    from cupy_llama.backends.cuda import launch
    from cupy_llama.backends.cuda.device import device_limits
    if device_limits()["capability"] < 90:
        pytest.skip("programmatic launches and clusters need sm_90 or newer")
    assert launch.launch_attributes_usable()


@pytest.mark.parametrize("m", [4, 16])
def test_programmatic_launches_give_the_same_bits_eager_and_in_a_graph(cp, rng, m):
    """The programmatic (overlapping) launch only moves when a kernel starts: a chain of
    fused products gives the same bits with it on or off, eagerly and replayed from a
    CUDA graph (at 16 rows the normed product stages x in clusters: staging_cluster)."""
    from cupy_llama.backends.cuda import gemm, launch
    if not launch.launch_attributes_usable():
        pytest.skip("programmatic launches need cuLaunchKernelEx and an sm_90+ GPU")
    k, n = 2048, 2048
    norm_bits, _ = random_bf16(rng, (k,))
    w_bits, _ = random_bf16(rng, (n, k), scale=0.02)
    up_bits, _ = random_bf16(rng, (2 * n, k), scale=0.02)
    norm_w, w, up = cp.asarray(norm_bits), cp.asarray(w_bits), cp.asarray(up_bits)
    start = _residual(rng, m, k)

    def chain(products, residual, act):
        for _ in range(3):
            assert products.norm_gate_up_act(residual, norm_w, EPS, up, act), "not fused"
            products.linear(act[:, :k], w, residual, accumulate=True)

    results = {}
    for on in (False, True):
        products = gemm.Products("mma", programmatic=on)
        assert products.programmatic == on
        residual, act = cp.asarray(start), cp.empty((m, n), np.uint16)
        chain(products, residual, act)
        results[("eager", on)] = cp.asnumpy(residual)
        stream = cp.cuda.Stream(non_blocking=True)
        residual, act = cp.asarray(start), cp.empty((m, n), np.uint16)
        with stream:
            stream.begin_capture()
            chain(products, residual, act)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        results[("graph", on)] = cp.asnumpy(residual)
    reference = results[("eager", False)]
    assert not np.isnan(reference).any()
    for key, value in results.items():
        np.testing.assert_array_equal(value, reference, err_msg=f"{key} differs from eager, plain launches")
