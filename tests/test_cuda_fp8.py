"""FP8 weights on the GPU against the NumPy FP8 reference (cupy_llama/fp8.py): quantizing
and dequantizing bit for bit, the e4m3 -> bf16 conversion of the skinny kernels exact for
every code, every FP8 product path (1 to 16 rows on the skinny kernels, plain and fused;
17 to 256 through the dequantized weight and cuBLAS) within the bf16 products' bounds,
and a whole FP8 model on the GPU against the CPU, eagerly and from the CUDA graphs.
Needs CuPy and a CUDA GPU of compute capability 8.9 or newer (quantization's
conversion instruction)."""
from __future__ import annotations

import numpy as np
import pytest
from test_cuda_graphs import (EAGER_TOLERANCE, REFERENCE_TOLERANCE, Sequences,
                              assert_kv_written_by, assert_logits_close)
from test_cuda_ops import REF, _gpu_available, poisoned, random_bf16, to_float
from test_cuda_ops import cp, rng  # noqa: F401  (fixtures)

from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from cupy_llama.fp8 import E4M3_VALUES, dequantize_rows, e4m3_to_float32, quantize_rows
from cupy_llama.interface import Fp8Weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]

SKINNY_ROWS = (1, 2, 3, 8, 9, 16)
WIDE_ROWS = (17, 24, 64, 128, 200, 256)
EPS = 1e-5


def fp8_weight(cp, rng, n, k, scale=0.05):
    """A random FP8 weight [n, k] on the device and its float32 value on the host."""
    bits, values = random_bf16(rng, (n, k), scale=scale)
    values[0, : min(k, 8)] *= 1e-4  # a few values in e4m3's subnormal range
    codes, row_scale = quantize_rows(values)
    weight = Fp8Weight(cp.asarray(codes), cp.asarray(row_scale))
    return weight, e4m3_to_float32(codes), row_scale


def _relative_error(got, expected) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert not np.isnan(got).any(), "NaN left in the output"
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


# ------------------------------------------------------------------ quantization

@pytest.mark.parametrize("n, k", [(64, 2048), (5, 100), (1000, 8)])
def test_quantize_on_the_device_equals_the_reference_bit_for_bit(cp, rng, n, k):
    from cupy_llama.backends.cuda import fp8
    bits, values = random_bf16(rng, (n, k), scale=0.5)
    values[1] = 0.0
    bits[1] = 0
    bits[2] = float32_to_bf16_bits(values[2] * np.float32(1e-30))  # tiny rows: scale FLT_MIN
    values = bf16_bits_to_float32(bits)
    codes, scale = quantize_rows(values)
    # into rows of a larger matrix, as the loader writes each source tensor
    big_codes = cp.full((n + 3, k), 0xAB, np.uint8)
    big_scale = cp.full(n + 3, np.nan, np.float32)
    fp8.quantize_rows(cp.asarray(bits), big_codes[2:2 + n], big_scale[2:2 + n])
    assert np.array_equal(cp.asnumpy(big_codes[2:2 + n]), codes)
    assert np.array_equal(cp.asnumpy(big_scale[2:2 + n]), scale)
    assert (cp.asnumpy(big_codes[:2]) == 0xAB).all() and (cp.asnumpy(big_codes[2 + n:]) == 0xAB).all()


def test_every_code_converts_to_bf16_exactly(cp):
    """The skinny kernels' in-register conversion (common.cuh e4m3x8_to_bf16x8), through
    dequantize with unit scales: every non-NaN code gives its value as a bf16, exactly."""
    from cupy_llama.backends.cuda import fp8
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[~np.isnan(E4M3_VALUES)].reshape(-1, 2)  # 254 codes, 2 per row ... K % 8
    codes = np.tile(codes, (1, 8))  # rows of 16
    out = cp.empty(codes.shape, np.uint16)
    fp8.dequantize(Fp8Weight(cp.asarray(codes), cp.ones(codes.shape[0], np.float32)), out)
    assert np.array_equal(bf16_bits_to_float32(cp.asnumpy(out)), e4m3_to_float32(codes))


@pytest.mark.parametrize("n, k", [(96, 2048), (7, 40)])
def test_dequantize_equals_the_reference_rounded_to_bf16(cp, rng, n, k):
    from cupy_llama.backends.cuda import fp8
    weight, _, _ = fp8_weight(cp, rng, n, k)
    out = poisoned(cp, (n, k))
    fp8.dequantize(weight, out)
    expected = float32_to_bf16_bits(dequantize_rows(cp.asnumpy(weight.data), cp.asnumpy(weight.scale)))
    assert np.array_equal(cp.asnumpy(out), expected)


def test_scale_product_scales_each_sum_by_its_row_and_column(cp, rng):
    """cuBLASLt's sums times the x row's and the weight row's scale, stored three ways."""
    from cupy_llama.backends.cuda import fp8
    acc = rng.standard_normal((37, 48), dtype=np.float32) * 100
    x_scale = rng.random(37, dtype=np.float32)
    w_scale = rng.random(48, dtype=np.float32)
    expected = acc * x_scale[:, None] * w_scale[None, :]  # float32, in that order
    out = poisoned(cp, acc.shape)
    fp8.scale_product(cp.asarray(acc), cp.asarray(x_scale), cp.asarray(w_scale), out)
    assert np.array_equal(cp.asnumpy(out), float32_to_bf16_bits(expected))
    out = cp.zeros(acc.shape, np.float32)
    fp8.scale_product(cp.asarray(acc), cp.asarray(x_scale), cp.asarray(w_scale), out)
    assert np.array_equal(cp.asnumpy(out), expected)
    start = rng.standard_normal(acc.shape, dtype=np.float32)
    out = cp.asarray(start)
    fp8.scale_product(cp.asarray(acc), cp.asarray(x_scale), cp.asarray(w_scale), out,
                      accumulate=True)
    assert np.array_equal(cp.asnumpy(out), start + expected)


# ------------------------------------------------------------------ products

def reference_product(x, values, scale):
    """What the skinny kernels compute: the codes' values against x, then the row scales."""
    return (x.astype(np.float64) @ values.T.astype(np.float64)) * scale.astype(np.float64)


def reference_w8a8(x, values, scale):
    """What the cuBLASLt path computes: x quantized per row to e4m3 too, then both scales."""
    x_codes, x_scale = quantize_rows(x)
    return reference_product(e4m3_to_float32(x_codes), values, scale) * x_scale[:, None].astype(np.float64)


def fp8_products(cp, gemm, n, k, fp8_gemm="cublaslt", skinny="auto", rows=256):
    """Products with the scratch a backend gives them for FP8 weights of [n, k]."""
    scratch = (cp.empty(rows * k, np.uint8), cp.empty(rows, np.float32),
               cp.empty(rows * n, np.float32))
    return gemm.Products(skinny, dequantized=cp.empty(n * k, np.uint16), fp8_activations=scratch,
                         fp8_gemm=fp8_gemm)


@pytest.mark.parametrize("out_dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("k, n", [(2048, 3072), (8192, 2048), (200, 1001), (64, 48)])
def test_linear_of_fp8_weights_at_every_row_count(cp, rng, k, n, out_dtype):
    """1 to 16 rows on the skinny FP8 kernels (the wide variant for long rows), 17 to 256
    through cuBLASLt's FP8 product (x quantized per row) where it takes the shape, else
    the dequantized weight and cuBLAS; every switch."""
    from cupy_llama.backends.cuda import gemm
    weight, values, scale = fp8_weight(cp, rng, n, k)
    capability = int(cp.cuda.Device().compute_capability)
    for skinny in ("auto", "cublas"):
        for fp8_gemm in ("cublaslt", "dequantize"):
            products = fp8_products(cp, gemm, n, k, fp8_gemm, skinny)
            for m in SKINNY_ROWS + WIDE_ROWS:
                x_bits, x = random_bf16(rng, (m, k))
                out = poisoned(cp, (m, n), out_dtype)
                x_device = cp.asarray(x_bits)
                products.linear(x_device, weight, out)
                # the route linear takes: the skinny kernel where it can stage x (16 rows of
                # K = 8192 do not fit its shared memory), else cuBLASLt or the dequantized weight
                skinny_fits = m <= 16 and gemm.mma_unsupported(x_device, weight) is None
                path = "mma" if skinny_fits else products.fp8_path(m, n, k)
                if not skinny_fits and fp8_gemm == "cublaslt" and capability >= 90 \
                        and k % 16 == 0 and n % 16 == 0:
                    assert path == "cublaslt", f"cuBLASLt refused [{m},{k}]x[{n},{k}]^T"
                if path == "cublaslt":
                    expected, bound = reference_w8a8(x, values, scale), 5e-3
                else:
                    expected, bound = reference_product(x, values, scale), 1e-2
                rel = _relative_error(to_float(cp, out), expected)
                assert rel < bound, f"{skinny}/{path} [{m},{k}]x[{n},{k}]^T fp8: relative error {rel:.3g}"


@pytest.mark.parametrize("m", SKINNY_ROWS + (40,))
def test_linear_of_fp8_weights_accumulates(cp, rng, m):
    from cupy_llama.backends.cuda import gemm
    k, n = 2048, 512
    weight, values, scale = fp8_weight(cp, rng, n, k)
    products = fp8_products(cp, gemm, n, k)
    x_bits, x = random_bf16(rng, (m, k))
    start = rng.standard_normal((m, n), dtype=np.float32)
    out = cp.asarray(start)
    products.linear(cp.asarray(x_bits), weight, out, accumulate=True)
    added = cp.asnumpy(out).astype(np.float64) - start
    w8a8 = m > 16 and products.fp8_path(m, n, k) == "cublaslt"
    expected = (reference_w8a8 if w8a8 else reference_product)(x, values, scale)
    rel = _relative_error(added, expected)
    assert rel < 1e-2, f"accumulate {m} rows: relative error {rel:.3g}"


def _normed(x, norm_w, offset=0.0):
    h = np.empty_like(x)
    REF.rms_norm(x, norm_w, EPS, h, offset=offset)
    return bf16_bits_to_float32(float32_to_bf16_bits(h))


@pytest.mark.parametrize("k, inter", [(2048, 8192), (1152, 6912), (64, 96)])
def test_fused_norm_products_of_fp8_weights(cp, rng, k, inter):
    """norm_linear and norm_gate_up_act's FP8 kernels (the scale before the activation)."""
    from cupy_llama.backends.cuda import gemm
    products = gemm.Products("mma")
    norm_bits, norm_w = random_bf16(rng, (k,))
    weight, values, scale = fp8_weight(cp, rng, 2 * inter, k)
    for m in SKINNY_ROWS:
        x = rng.standard_normal((m, k), dtype=np.float32) * 3
        h = _normed(x, norm_w)
        out = poisoned(cp, (m, 2 * inter), np.float32)
        assert products.norm_linear(cp.asarray(x), cp.asarray(norm_bits), EPS, weight, out)
        rel = _relative_error(cp.asnumpy(out), reference_product(h, values, scale))
        assert rel < 1e-2, f"norm_linear fp8 {m} rows: {rel:.3g}"
        gate_up = bf16_bits_to_float32(float32_to_bf16_bits(
            reference_product(h, values, scale).astype(np.float32)))
        expected = np.empty((m, inter), np.float32)
        REF.act_and_mul(gate_up, expected, "silu")
        act = poisoned(cp, (m, inter))
        assert products.norm_gate_up_act(cp.asarray(x), cp.asarray(norm_bits), EPS, weight, act)
        rel = _relative_error(to_float(cp, act), expected)
        assert rel < 2e-2, f"norm_gate_up_act fp8 {m} rows: {rel:.3g}"


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 32, 8), (128, 16, 8)])
def test_fused_qkv_rope_of_fp8_weights(cp, rng, head_dim, num_heads, num_kv_heads):
    from test_cuda_fused import check_norm_qkv_rope

    from cupy_llama.backends.cuda import gemm
    k = 2048
    weight, values, scale = fp8_weight(cp, rng, (num_heads + 2 * num_kv_heads) * head_dim, k)
    check_norm_qkv_rope(cp, rng, gemm.Products("mma"), weight, values * scale[:, None], k,
                        head_dim, num_heads, num_kv_heads, rows=SKINNY_ROWS)


# ------------------------------------------------------------------ a whole model

@pytest.fixture(scope="module", params=["llama", "qwen3"])
def fp8_model(request, tmp_path_factory):
    """A random model quantized at load: Llama's shape, and Qwen3's (q/k head norms after
    the FP8 qkv product, head_dim 128)."""
    from cupy_llama.bench.random_model import make_random_model
    from cupy_llama.config import EngineConfig
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    family = {"llama": {}, "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=128)}
    directory = make_random_model(
        tmp_path_factory.mktemp("fp8") / "model", "tiny", seed=0, hidden_size=512,
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=768, vocab_size=1000,
        tie_word_embeddings=False, **family[request.param])
    config = EngineConfig(quantization="fp8").model_config(read_config(directory))
    return model_for(config), open_checkpoint(directory, model_for(config))


# the CPU computes with bf16 activations (W8A16): the dequantize path is held to the bf16
# bound; the cuBLASLt path quantizes the x of prefill steps to e4m3 too, a looser bound
FP8_PATHS = {("auto", "dequantize"): REFERENCE_TOLERANCE, ("cublas", "dequantize"): REFERENCE_TOLERANCE,
             ("auto", "cublaslt"): 0.15}


@pytest.mark.parametrize("skinny, fp8_gemm", sorted(FP8_PATHS))
def test_an_fp8_model_on_the_gpu_matches_the_cpu(fp8_model, rng, skinny, fp8_gemm):
    """Quantized at load on both sides (the device's codes equal the CPU's), then prefill
    chunks (step graphs; cuBLASLt or dequantized weights) and decode rounds (decode graphs,
    skinny FP8 kernels) against the eager pass and the CPU reference."""
    import cupy
    from test_cuda_families import MAX_MODEL_LEN, NUM_KV_BLOCKS, NUM_SEQS

    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.backends.cuda.backend import CudaBackend
    from cupy_llama.backends.cuda.switches import KernelSwitches
    model, checkpoint = fp8_model
    cpu = CpuBackend(model, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                     block_size=16, num_kv_blocks=NUM_KV_BLOCKS)
    gpu = CudaBackend(model, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                      max_num_batched_tokens=256, block_size=16, num_kv_blocks=NUM_KV_BLOCKS,
                      switches=KernelSwitches(skinny_gemm=skinny, fp8_gemm=fp8_gemm))
    cpu_tolerance = FP8_PATHS[skinny, fp8_gemm]  # the KV cache carries prefill's error on
    assert gpu.graphs is not None, f"graphs are off: {gpu.graphs_off_reason}"
    for key in ("layers.0.qkv", "layers.1.down"):
        on_gpu, on_cpu = gpu.weights[key], cpu.weights[key]
        assert np.array_equal(e4m3_to_float32(cupy.asnumpy(on_gpu.data)), on_cpu.data), key
        assert np.array_equal(cupy.asnumpy(on_gpu.scale), on_cpu.scale), key
    seqs = Sequences([rng.integers(0, 1000, n) for n in [300, 37, 120, 16, 1, 90, 64, 8]],
                     NUM_KV_BLOCKS, rng)
    while True:
        counts = {b: min(80, len(t) - 1 - seqs.computed[b]) for b, t in enumerate(seqs.tokens)}
        counts = dict([(b, n) for b, n in counts.items() if n > 0][:3])
        if not counts:
            break
        batch = seqs.batch(counts)
        assert_logits_close(cupy.asnumpy(gpu.forward(batch)), cpu.forward(batch),
                            cpu_tolerance, f"fp8/{skinny}/{fp8_gemm}: prefill {counts}")
        seqs.advance(counts)
    for members in ([0], [1, 2, 3], list(range(NUM_SEQS))):
        for step in range(3):
            batch = seqs.batch({b: 1 for b in members})
            what = f"fp8/{skinny}/{fp8_gemm}: decode of {len(members)}, step {step}"
            expected = cpu.forward(batch)
            replayed = cupy.asnumpy(gpu.forward(batch))
            eager = cupy.asnumpy(gpu.model.forward(gpu, batch))
            assert_logits_close(replayed, eager, EAGER_TOLERANCE, f"{what}: graph vs eager")
            assert_logits_close(replayed, expected, cpu_tolerance, f"{what}: graph vs CPU")
            seqs.advance({b: 1 for b in members}, np.argmax(expected, axis=-1))
    assert_kv_written_by(gpu, seqs)
    rows = {name: note for name, _, note in gpu.memory_plan()}
    assert "FP8" in rows["weights"] and "FP8 dequantized weight" in rows
    gpu.close()

