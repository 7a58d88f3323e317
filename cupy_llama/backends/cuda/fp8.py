"""Launchers for fp8.cu: FP8 (e4m3) weights quantized on the device at load, and
dequantized to bf16 for the products that go to cuBLAS (gemm.py). cupy_llama/fp8.py is
the reference, bit for bit."""
from __future__ import annotations

from ...interface import Fp8Weight
from ...util import cdiv
from .kernels import BF16, F32, U8, check, constants, get_kernel, i32, i64

THREADS = constants("fp8")["FP8_THREADS"]
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
