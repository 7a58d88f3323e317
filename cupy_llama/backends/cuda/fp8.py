"""Launchers for fp8.cu: FP8 (e4m3) weights quantized on the device at load, and
dequantized to bf16 for the products that go to cuBLAS (gemm.py). cupy_llama/fp8.py is
the reference, bit for bit."""
from __future__ import annotations

from ...interface import Fp8Weight
from ...util import cdiv
from .kernels import BF16, F32, U8, check, constants, get_kernel, i32, i64

_C = constants("fp8")
THREADS = _C["FP8_THREADS"]
OUT_BF16, OUT_F32, OUT_F32_ADD = _C["OUT_BF16"], _C["OUT_F32"], _C["OUT_F32_ADD"]
MIN_CAPABILITY = 89  # the e4m3 conversion instruction quantize_rows_kernel uses


def quantize_rows(weight, codes, scale) -> None:
    """weight [N, K] bf16 -> codes [N, K] uint8 (e4m3), scale [N] float32: each row over its
    largest magnitude / 448, rounded to nearest even and saturated (fp8.py quantize_rows).
    codes and scale may be views into a larger matrix (rows side by side)."""
    n, k = check("weight", weight, BF16, ndim=2).shape
    check("codes", codes, U8, shape=(n, k))
    check("scale", scale, F32, shape=(n,))
    if n and k:
        get_kernel("fp8", "quantize_rows_kernel")((n,), (THREADS,), (weight, codes, scale, i32(k)))


def dequantize(weight: Fp8Weight, out) -> None:
    """out [N, K] bf16 = bf16(value(codes) * scale), row by row; K % 8 == 0 and 16-byte
    aligned rows."""
    n, k = check("codes", weight.data, U8, ndim=2).shape
    check("scale", weight.scale, F32, shape=(n,))
    check("out", out, BF16, shape=(n, k))
    if k % 8 or weight.data.data.ptr % 16 or out.data.ptr % 16:
        raise ValueError(f"dequantize: needs K a multiple of 8 and 16-byte aligned rows "
                         f"(got K {k})")
    words = n * k // 8
    if words:
        get_kernel("fp8", "dequantize_rows_kernel")(
            (cdiv(words, THREADS),), (THREADS,), (weight.data, weight.scale, out, i32(k), i64(words)))


def scale_product(acc, x_scale, w_scale, out, accumulate: bool = False) -> None:
    """out [M, N] = acc [M, N] float32 * x_scale[m] * w_scale[n]: bf16 or float32, or added
    to a float32 out (accumulate)."""
    m_rows, n = check("acc", acc, F32, ndim=2).shape
    check("x_scale", x_scale, F32, shape=(m_rows,))
    check("w_scale", w_scale, F32, shape=(n,))
    if out.dtype not in (BF16, F32) or (accumulate and out.dtype != F32):
        raise ValueError(f"out: expected {'float32' if accumulate else 'bf16 or float32'}, "
                         f"got {out.dtype.name}")
    check("out", out, out.dtype, shape=(m_rows, n))
    mode = OUT_F32_ADD if accumulate else OUT_F32 if out.dtype == F32 else OUT_BF16
    total = m_rows * n
    if total:
        get_kernel("fp8", "scale_product_kernel")(
            (cdiv(total, THREADS),), (THREADS,), (acc, x_scale, w_scale, out, i32(n), i64(total),
                                                  i32(mode)))
